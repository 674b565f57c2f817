"""preprocess --sft and PackedSFTDataset: trained tokens against transformers' own assistant mask, packing against
brute force, layout of samples against the conversations' token lists, errors naming the row."""
import itertools
import json
import os
import pickle
import re

import numpy as np
import pytest
import torch

import chat_data
from ds_megatron.data.gpt_dataset import split_document_ranges, split_fractions
from ds_megatron.data.indexed_dataset import IndexedDataset
from ds_megatron.data.preprocess import main, preprocess_sft
from ds_megatron.data.sft import PADDING, TRAINED, UNTRAINED, PackedSFT, best_fit_decreasing, is_packed_sft
from ds_megatron.data.sft_dataset import PackedSFTDataset

transformers = pytest.importorskip("transformers")

S = 640  # every conversation of CHATS fits


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"marked": chat_data.write_tokenizer(str(root / "marked")),
            "plain": chat_data.write_tokenizer(str(root / "plain"), generation_markers=False)}


@pytest.fixture(scope="module")
def hf(toks):
    return transformers.AutoTokenizer.from_pretrained(toks["marked"])


CHATS = chat_data.conversations(40, seed=3)


def reference(hf, messages):
    """transformers' own token ids and assistant mask of a conversation."""
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def conversations_on_disk(prefix):
    """(tokens, flags) of every conversation in packed order, and the packed rows as lists of their indices."""
    packed = PackedSFT(prefix, json.load(open(prefix + ".sft.json"))["seq_length"])
    convs, rows = [], []
    for r in range(packed.num_rows):
        rows.append([])
        for s in range(packed.row_sequences[r], packed.row_sequences[r + 1]):
            ids, flags = packed.tokens[s].tolist(), packed.flags[s].tolist()
            if set(flags) == {PADDING}:
                assert s == packed.row_sequences[r + 1] - 1, "padding is the row's tail"
                continue
            assert PADDING not in flags
            rows[-1].append(len(convs))
            convs.append((ids, flags))
    return convs, rows


def files(prefix):
    exts = (".bin", ".idx", ".stats.json", ".trained.bin", ".trained.idx", ".trained.stats.json", ".sft.json")
    return {ext: open(prefix + ext, "rb").read() for ext in exts}


@pytest.fixture(scope="module")
def packed(toks, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    src = chat_data.write_jsonl(str(root / "chat.jsonl"), CHATS)
    prefix = str(root / "sft")
    stats = preprocess_sft(src, prefix, toks["marked"], S)
    return prefix, stats


def test_trained_tokens_are_the_templates_assistant_mask(hf, packed):
    prefix, stats = packed
    want = [reference(hf, row["messages"]) for row in CHATS]
    got, rows = conversations_on_disk(prefix)
    # Every conversation exactly once, its ids and trained flags those of apply_chat_template.
    assert sorted(got) == sorted(want)
    assert stats.trained_tokens == sum(sum(mask) for _, mask in want) > 0
    assert (stats.rows, stats.documents, stats.truncated, stats.dropped, stats.untrained) == (40, 40, 0, 0, 0)
    assert stats.tokens == sum(len(ids) for ids, _ in want)
    assert all(sum(len(got[c][0]) for c in row) <= S for row in rows)
    assert stats.packed_rows == len(rows)
    assert stats.packing_efficiency == stats.tokens / (len(rows) * S)


def test_a_template_without_markers_trains_the_same_tokens(toks, packed, tmp_path):
    prefix, _ = packed
    src = chat_data.write_jsonl(str(tmp_path / "chat.jsonl"), CHATS)
    stats = preprocess_sft(src, str(tmp_path / "plain"), toks["plain"], S)
    marked, plain = files(prefix), files(str(tmp_path / "plain"))
    for ext in (".bin", ".idx", ".trained.bin", ".trained.idx"):
        assert plain[ext] == marked[ext], ext
    flags = np.frombuffer(plain[".trained.bin"], dtype=np.uint8)
    # Megatron-Bridge #3359: a marker-less template must not fall back to training every token.
    assert (flags == UNTRAINED).sum() > (flags == TRAINED).sum() > 0
    assert stats.trained_tokens == int((flags == TRAINED).sum())


def test_one_and_four_workers_write_identical_files(toks, tmp_path):
    rows = CHATS[:24] + [{"prompt": "Say hi.", "completion": " Hi."}, {"text": "Plain text row."}] * 3
    src = chat_data.write_jsonl(str(tmp_path / "mixed.jsonl"), rows)
    one = preprocess_sft(src, str(tmp_path / "w1"), toks["plain"], 512, workers=1)
    four = preprocess_sft(src, str(tmp_path / "w4"), toks["plain"], 512, workers=4)
    assert one == four and one.truncated > 0
    assert files(str(tmp_path / "w1")) == files(str(tmp_path / "w4"))


def brute_force_bfd(lengths, capacity, seed):
    """Best-fit-decreasing as the textbook states it: each item, longest first (ties by a seeded shuffle), into
    the open bin with the least room that holds it, the earliest such bin, else a new bin."""
    tie = {item: rank for rank, item in enumerate(np.random.RandomState(seed).permutation(len(lengths)))}
    bins, room = [], []
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], tie[i])):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[item]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(item)
        room[b] -= lengths[item]
    return bins


def optimal_bins(lengths, capacity):
    """The fewest bins that hold ``lengths`` (exhaustive)."""
    lengths = sorted(lengths, reverse=True)

    def place(i, rooms):
        if i == len(lengths):
            return True
        tried = set()
        for b, room in enumerate(rooms):
            if room >= lengths[i] and room not in tried:  # bins with equal room are interchangeable
                tried.add(room)
                if place(i + 1, rooms[:b] + [room - lengths[i]] + rooms[b + 1:]):
                    return True
        return False

    return next(k for k in itertools.count(1) if place(0, [capacity] * k))


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_decreasing_is_the_brute_force_one(seed):
    rng = np.random.RandomState(100 + seed)
    capacity = int(rng.choice([10, 16, 37]))
    lengths = rng.randint(1, capacity + 1, size=int(rng.randint(1, 40))).tolist()
    bins = best_fit_decreasing(lengths, capacity, seed)
    assert bins == brute_force_bfd(lengths, capacity, seed)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    small = lengths[:9]
    opt = optimal_bins(small, capacity)
    assert opt <= len(best_fit_decreasing(small, capacity, seed)) <= 11 / 9 * opt + 6 / 9  # Dosa's bound


def test_truncation_and_drop_are_counted(hf, toks, tmp_path):
    rows = CHATS[:20] + [{"messages": [{"role": "user", "content": "Nothing to answer."}]}]
    src = chat_data.write_jsonl(str(tmp_path / "chat.jsonl"), rows)
    full = [reference(hf, row["messages"]) for row in rows[:20]]
    max_length = 150
    longer = sum(len(ids) > max_length for ids, _ in full)
    assert 0 < longer < 20

    right = preprocess_sft(src, str(tmp_path / "right"), toks["marked"], 256, max_length=max_length)
    cut = [(ids[:max_length], mask[:max_length]) for ids, mask in full] + [reference(hf, rows[20]["messages"])]
    untrained = [line for line, (_, mask) in enumerate(cut, start=1) if not any(mask[1:])]
    assert untrained[-1] == 21
    got, _ = conversations_on_disk(str(tmp_path / "right"))
    assert sorted(got) == sorted(w for w in cut if any(w[1][1:]))
    assert (right.truncated, right.dropped, right.untrained, right.documents) == (
        longer, 0, len(untrained), 21 - len(untrained))
    assert right.untrained_where == [f"--input {src!r} line {line}" for line in untrained[:3]]

    drop = preprocess_sft(src, str(tmp_path / "drop"), toks["marked"], 256, max_length=max_length,
                          truncation="drop")
    got, _ = conversations_on_disk(str(tmp_path / "drop"))
    assert sorted(got) == sorted(w for w in full if len(w[0]) <= max_length)
    assert (drop.rows, drop.dropped, drop.untrained, drop.documents) == (21, longer, 1, 20 - longer)

    with pytest.raises(ValueError, match=r"no conversation is left to train out of 1 rows .*1 with nothing"):
        preprocess_sft(chat_data.write_jsonl(str(tmp_path / "none.jsonl"), rows[20:]), str(tmp_path / "none"),
                       toks["marked"], 256)
    assert not os.path.exists(tmp_path / "none.bin")


def test_prompt_completion_and_text_rows(hf, toks, tmp_path):
    turns = next(row["messages"] for row in CHATS if len(row["messages"]) > 3)
    k = max(k for k, turn in enumerate(turns) if turn["role"] == "assistant")  # earlier answers: the prompt
    rows = [{"prompt": "What is a heap?", "completion": " A tree with the heap property."},
            {"text": "Return the smallest item."},
            {"prompt": turns[:k], "completion": turns[k:]}]
    src = chat_data.write_jsonl(str(tmp_path / "pc.jsonl"), rows)
    eos = hf.eos_token_id
    p, c = hf(rows[0]["prompt"])["input_ids"], hf(rows[0]["completion"], add_special_tokens=False)["input_ids"]
    text = hf(rows[1]["text"])["input_ids"]
    ids, mask = reference(hf, turns)
    head = len(hf.apply_chat_template(turns[:k], tokenize=True, return_dict=True,
                                      add_generation_prompt=True)["input_ids"])
    want = [(p + c + [eos], [0] * len(p) + [1] * (len(c) + 1)), (text + [eos], [1] * (len(text) + 1)),
            (ids, [0] * head + mask[head:])]
    for kind in ("marked", "plain"):
        assert preprocess_sft(src, str(tmp_path / kind), toks[kind], 1024).truncated == 0
        got, _ = conversations_on_disk(str(tmp_path / kind))
        assert sorted(got) == sorted(want)


def test_parquet_and_a_datasets_directory_read_the_jsonl_rows(toks, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = CHATS[:6] + [{"prompt": "Say hi.", "completion": " Hi."}, {"text": "Plain text row."}]
    jsonl = chat_data.write_jsonl(str(tmp_path / "rows.jsonl"), rows)
    # One column per field, None where a row lacks it (arrow columns are shared by every row).
    columns = {k: [row.get(k) for row in rows] for k in ("messages", "prompt", "completion", "text")}
    ds = datasets.Dataset.from_dict(columns)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "rows_ds"))
    want = None
    for name in ("rows.jsonl", "rows.parquet", "rows_ds"):
        stats = preprocess_sft(str(tmp_path / name), str(tmp_path / f"out_{name}"), toks["marked"], 512)
        got = {k: v for k, v in files(str(tmp_path / f"out_{name}")).items() if k != ".sft.json"}
        want = want or got
        assert got == want and stats.rows == len(rows)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"holds several splits \(test, train\); pass the directory of one"):
        preprocess_sft(str(tmp_path / "dict"), str(tmp_path / "x"), toks["marked"], 512)
    bad = datasets.Dataset.from_dict({"messages": [rows[0]["messages"], [{"role": "bot", "content": "x"}]]})
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"bad\.parquet' row 1: messages\[0\] has role 'bot'"):
        preprocess_sft([jsonl, str(tmp_path / "bad.parquet")], str(tmp_path / "x"), toks["marked"], 512)


@pytest.mark.parametrize("line, error", [
    ('{"messages": oops}', r"line 3 is not valid JSON"),
    ('{"conversation": []}', r"line 3 has no 'messages', 'prompt' / 'completion' or 'text' \(found: conversation\)"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', r"line 3: messages\[0\] has role 'bot'; use one of system"),
    ('{"messages": [{"role": "user"}]}', r"line 3: messages\[0\] \(user\) has no string 'content'"),
    ('{"prompt": "a"}', r"line 3 has 'prompt' but no 'completion'"),
])
def test_a_bad_row_is_named_and_an_older_dataset_is_kept(toks, packed, tmp_path, line, error):
    prefix, _ = packed
    before, listing = files(prefix), sorted(os.listdir(os.path.dirname(prefix)))
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join([json.dumps(CHATS[0]), json.dumps(CHATS[1]), line, json.dumps(CHATS[2])]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"--input {str(src)!r} ") + error):
        preprocess_sft(str(src), prefix, toks["marked"], S)
    assert files(prefix) == before and sorted(os.listdir(os.path.dirname(prefix))) == listing


def test_a_template_that_rewrites_earlier_turns_is_refused_without_markers(toks, tmp_path):
    # Like templates that drop an earlier answer's reasoning: the conversation up to a turn is no prefix of it.
    template = chat_data.CHAT_TEMPLATE.replace("message['content'] + '<|im_end|>",
                                               "(message['content'] if loop.last else 'old') + '<|im_end|>", 1)
    rewriting = chat_data.write_tokenizer(str(tmp_path / "tok"), chat_template=template)
    two_turns = next(row for row in CHATS if sum(t["role"] == "assistant" for t in row["messages"]) > 1)
    one_turn = next(row for row in CHATS if sum(t["role"] == "assistant" for t in row["messages"]) == 1)
    src = chat_data.write_jsonl(str(tmp_path / "c.jsonl"), [one_turn, two_turns])
    with pytest.raises(ValueError, match=r"line 2: the chat template renders the turns up to turn \d+ \(assistant\) "
                                         r"differently .* put \{% generation %\}"):
        preprocess_sft(src, str(tmp_path / "out"), rewriting, S)
    src = chat_data.write_jsonl(str(tmp_path / "a.jsonl"), [{"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"line 1: the first turn is an assistant turn"):
        preprocess_sft(src, str(tmp_path / "out"), toks["plain"], S)


def expected_sample(tokens, segments, pad):
    """labels, loss mask and positions written out position by position from the conversations' own lists."""
    labels, loss, positions = [], [], []
    for ids, flags in segments:
        for j in range(len(ids)):
            last = j == len(ids) - 1
            labels.append(pad if last else ids[j + 1])
            loss.append(0.0 if last else float(flags[j + 1] == 1))
            positions.append(j)
    return labels, loss, positions


def test_samples_follow_the_conversations(hf, packed):
    prefix, stats = packed
    masks = {tuple(ids): mask for ids, mask in (reference(hf, row["messages"]) for row in CHATS)}
    ds = PackedSFTDataset(prefix, S)
    assert len(ds) == stats.packed_rows
    pad = json.load(open(prefix + ".sft.json"))["pad_id"]
    total_loss = 0.0
    seen = []
    for i in range(len(ds)):
        sample = ds[i]
        assert {k: (v.dtype, tuple(v.shape)) for k, v in sample.items()} == {
            "tokens": (torch.int64, (S,)), "labels": (torch.int64, (S,)), "loss_mask": (torch.float32, (S,)),
            "position_ids": (torch.int64, (S,)), "padding_mask": (torch.bool, (S,))}
        tokens = sample["tokens"].tolist()
        segments, at = [], 0
        while at < S:
            ids = next((list(k) for k in masks if list(k) == tokens[at:at + len(k)]), None)
            if ids is None:  # the padding tail
                assert tokens[at:] == [pad] * (S - at)
                segments.append((tokens[at:], [PADDING] * (S - at)))
                break
            segments.append((ids, masks[tuple(ids)]))
            seen.append(tuple(ids))
            at += len(ids)
        labels, loss, positions = expected_sample(tokens, segments, pad)
        assert sample["labels"].tolist() == labels
        assert sample["loss_mask"].tolist() == loss
        assert sample["position_ids"].tolist() == positions
        tail = sum(len(ids) for ids, flags in segments if flags[:1] != [PADDING])
        assert sample["padding_mask"].tolist() == [False] * tail + [True] * (S - tail)
        total_loss += sum(loss)
    assert sorted(seen) == sorted(masks)
    # Each trained token is one loss position (no conversation starts with a trained token).
    assert total_loss == stats.trained_tokens


def test_the_order_does_not_depend_on_num_samples(packed):
    prefix, stats = packed
    one = PackedSFTDataset(prefix, S, seed=7)
    more = PackedSFTDataset(prefix, S, num_samples=3 * len(one) + 2, seed=7)
    rows = [more.row_of_sample(i) for i in range(len(more))]
    assert rows[:len(one)] == [one.row_of_sample(i) for i in range(len(one))]
    for e in range(3):  # each epoch visits every row once, in its own order
        assert sorted(rows[e * len(one):(e + 1) * len(one)]) == list(range(stats.packed_rows))
    assert rows[:len(one)] != rows[len(one):2 * len(one)]
    assert rows[:len(one)] != [PackedSFTDataset(prefix, S, seed=8).row_of_sample(i) for i in range(len(one))]
    i = len(one) + 1
    assert more[i]["tokens"].tolist() == one.packed.row(rows[i])[0].tolist()


def test_split_and_checks(packed):
    prefix, stats = packed
    # The job cuts packed rows as it cuts documents: the split's (start, end) fractions (training/build.py).
    train_split, valid_split = split_fractions("80,20")[:2]
    train = PackedSFTDataset(prefix, S, seed=1, split=train_split)
    valid = PackedSFTDataset(prefix, S, split=valid_split)
    want = split_document_ranges("80,20", stats.packed_rows)
    assert (train.rows, valid.rows) == (want[0], want[1]) and len(valid) == len(want[1]) > 0
    with pytest.raises(ValueError, match=rf"seq_length 512 differs from the seq_length {S} that data_path .* "
                                         rf"set seq_length to {S} or re-pack with --seq-length 512"):
        PackedSFTDataset(prefix, 512)
    assert is_packed_sft(prefix) and not is_packed_sft(prefix + "_none")
    assert PackedSFTDataset(IndexedDataset(prefix), S).packed.num_rows == stats.packed_rows
    copy = pickle.loads(pickle.dumps(train))  # as DataLoader workers receive it
    assert all(torch.equal(copy[3][k], train[3][k]) for k in train[3])


def test_an_unfinished_dataset_is_refused(packed, tmp_path):
    prefix, _ = packed
    copy = str(tmp_path / "copy")
    for ext, data in files(prefix).items():
        if ext != ".sft.json":
            open(copy + ext, "wb").write(data)
    assert is_packed_sft(copy)  # its flags mark it: it never reads as a pretraining dataset
    with pytest.raises(ValueError, match=r"has no .*copy\.sft\.json.* \(written last: the preprocessing did not "
                                         r"finish\); run `ds-megatron preprocess --sft"):
        PackedSFTDataset(copy, S)


def test_the_command_line(toks, tmp_path, capsys):
    src = chat_data.write_jsonl(str(tmp_path / "c.jsonl"), CHATS[:4] + [{"messages": [{"role": "user",
                                                                                    "content": "Hello?"}]}])
    prefix = str(tmp_path / "out")
    assert main(["--sft", "--input", src, "--input", src, "--output-prefix", prefix, "--tokenizer", toks["marked"],
                 "--seq-length", "512", "--truncation", "drop", "--seed", "3"]) == 0
    out = capsys.readouterr()
    assert (f"2 conversation(s) had no token to train and were left out (first: --input {src!r} line 5; "
            f"--input {src!r} line 5)") in out.err
    last = json.loads(out.out.strip().splitlines()[-1])
    assert list(last) == ["rows", "documents", "tokens", "trained_tokens", "packed_rows", "packing_efficiency",
                          "truncated", "dropped", "untrained"]
    assert last == json.load(open(prefix + ".sft.json"))["stats"]
    assert last["rows"] == last["documents"] + last["dropped"] + last["untrained"] == 10 and last["untrained"] == 2
    for argv, error in ((["--seq-length", "8"], "--seq-length apply only with --sft"),
                        (["--sft"], "--sft needs --tokenizer DIR"),
                        (["--sft", "--tokenizer", toks["marked"]], "--sft needs --seq-length S"),
                        (["--sft", "--tokenizer", toks["marked"], "--seq-length", "8", "--json-key", "x"],
                         "--json-key do"),
                        (["--input", src], "--input is given 2 times")):
        with pytest.raises(SystemExit):
            main(["--input", src, "--output-prefix", prefix] + argv)
        assert error in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--max-length 600 must lie in 1\.\.--seq-length 512"):
        main(["--sft", "--input", src, "--output-prefix", prefix, "--tokenizer", toks["marked"], "--seq-length",
              "512", "--max-length", "600"])
