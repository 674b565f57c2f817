"""The job's sample order depends on the data, seq_length, the split and the seed alone: a run extended later with
``--resume`` and a larger ``train_iters`` gives the unbroken longer run's losses exactly (plain data, a blend, rows
packed by Megatron's reset flags and a packed chat dataset),
the datasets agree sample by sample whatever the run's length or global batch, and a changed blend, split,
seq_length or seed on resume is refused in one line."""
import copy
import json
import os
import sysconfig

import numpy as np
import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.checkpointing.run_dir import check_resume
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.data.indexed_dataset import IndexedDatasetBuilder
from ds_megatron.data.tokenizer import ByteTokenizer
from ds_megatron.training.build import build_datasets
from ds_megatron.training.train import train

SHORT, LONG = 5, 9  # steps of the first run, and of the unbroken run and the extended one


def _config(out, steps, data, mbs=2):
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16,
                      "vocab_size": 520 if "tokenizer" in data else 257},  # the chat tokenizer's 514 ids
            # The cosine decay's length fixed (Megatron's lr_decay_iters): the schedule must not depend on train_iters.
            "train": {"train_iters": steps, "lr": 3e-3, "lr_warmup_iters": 2, "lr_decay_iters": LONG,
                      "eval_interval": 3, "eval_iters": 1, "output_dir": out},
            "data": copy.deepcopy(data),
        },
    }


def _stdlib_prefix(root, name, files):
    """A dataset of stdlib sources, each cut into 2 KB documents ending with the byte tokenizer's EOD."""
    prefix = os.path.join(root, name)
    tok = ByteTokenizer()
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for rel in files:
            with open(os.path.join(sysconfig.get_paths()["stdlib"], rel), encoding="utf-8") as f:
                ids = tok.tokenize(f.read())
            for i in range(0, len(ids), 2048):
                builder.add_document(ids[i:i + 2048] + [tok.eod])
    return prefix


@pytest.fixture(scope="module")
def blend_data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("blend"))
    a = _stdlib_prefix(root, "a", ["argparse.py"])
    b = _stdlib_prefix(root, "b", ["json/decoder.py", "textwrap.py", "shlex.py"])
    return {"data_path": ["0.3", a, "0.7", b], "split": "90,10"}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Documents of 3 to 19 random bytes and the EOD: several documents in every 16-token row."""
    prefix = str(tmp_path_factory.mktemp("short") / "short")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for _ in range(400):
            builder.add_document(list(rng.integers(0, 256, int(rng.integers(3, 20)))) + [ByteTokenizer().eod])
    return {"data_path": prefix, "split": "90,10", "reset_position_ids": True, "reset_attention_mask": True,
            "eod_mask_loss": True}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A packed chat dataset (``ds-megatron preprocess --sft``) of 16-token rows, its tokenizer with a template."""
    import chat_data as chats
    from ds_megatron.data.preprocess import preprocess_sft
    root = tmp_path_factory.mktemp("chat")
    tokenizer = chats.write_tokenizer(str(root / "tokenizer"))
    rows = [{"prompt": s[:4], "completion": s[4:10]} for s in chats.sentences()[:300]]  # about two a row
    prefix = str(root / "chat")
    preprocess_sft(chats.write_jsonl(str(root / "chat.jsonl"), rows), prefix, tokenizer, 16)
    return {"data_path": prefix, "tokenizer": tokenizer, "split": "90,10"}


PLAIN = {"default_corpus_bytes": 1_000_000, "split": "90,10"}


def _train(cfg, resume=False):
    job = load_job(cfg, dist.get_world_size())
    result = train(job, cfg, resume=resume, show_progress=False)
    return result.losses, result.val_losses


def _unbroken_and_extended(root, data):
    """(unbroken LONG-step run, a SHORT-step run, that run extended to LONG steps with --resume)."""
    unbroken = _train(_config(os.path.join(root, "unbroken"), LONG, data))
    first = _train(_config(os.path.join(root, "extended"), SHORT, data))
    second = _train(_config(os.path.join(root, "extended"), LONG, data), resume=True)
    return unbroken, first, second


def _assert_extension_is_exact(runs):
    (unbroken, unbroken_val), (first, first_val), (second, second_val) = runs
    assert sorted(first) == list(range(1, SHORT + 1)) and sorted(second) == list(range(SHORT + 1, LONG + 1))
    for step in range(1, SHORT + 1):
        assert first[step] == unbroken[step], step  # the shorter run read the same samples too
    for step in range(SHORT + 1, LONG + 1):
        assert second[step] == unbroken[step], step
    for step, val in {**first_val, **second_val}.items():  # the validation set is the same at every length
        if step in unbroken_val:
            assert val == unbroken_val[step], step
    assert len(set(unbroken.values())) == LONG  # the batches differ from step to step


@pytest.mark.parametrize("data", ["plain", "cyclic", "blend", "reset", "sft"])
def test_an_extended_run_gives_the_unbroken_runs_losses(tmp_path, data, blend_data, short_documents, chat_data):
    """With "reset": Megatron's reset_position_ids / reset_attention_mask / eod_mask_loss, rows of several
    documents; "sft": a packed chat dataset."""
    data = {"plain": PLAIN, "cyclic": {**PLAIN, "dataloader_type": "cyclic"}, "blend": blend_data,
            "reset": short_documents, "sft": chat_data}[data]
    _assert_extension_is_exact(run_on_ranks(1, _unbroken_and_extended, str(tmp_path), data)[0])
    if data is blend_data:
        # The extended run's cache: train and valid indices, the train ones extended from the first run's 5 x 4
        # samples to the 5 x 4 + 9 x 4 its build asked for.
        cache = os.path.join(str(tmp_path), "extended", "data_cache")
        assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 2
        (train,) = [f for f in os.listdir(cache) if f.endswith(".json")
                    and json.load(open(os.path.join(cache, f)))["split"] == "train"]
        indices = np.load(os.path.join(cache, train.replace("description.json", "indices.npy")))
        assert len(indices) == SHORT * 4 + LONG * 4


def test_a_changed_data_order_is_refused_on_resume(tmp_path, blend_data):
    out = str(tmp_path / "run")
    run_on_ranks(1, _train, _config(out, 2, blend_data))
    a, b = blend_data["data_path"][1], blend_data["data_path"][3]
    changes = {
        "data.data_path": ({**blend_data, "data_path": ["0.5", a, "0.5", b]}, {}),
        "data.split": ({**blend_data, "split": "80,20"}, {}),
        "train.seed": (blend_data, {"seed": 7}),
        "model.seq_length": (blend_data, {}),
    }
    for field, (data, train) in changes.items():
        cfg = _config(out, 4, data)
        cfg["megatron"]["train"].update(train)
        if field == "model.seq_length":
            cfg["megatron"]["model"]["seq_length"] = 32
        with pytest.raises(ConfigError) as error:
            check_resume(load_job(cfg, 1), out)
        message = str(error.value)
        assert message.startswith(f"megatron.{field}=") and "\n" not in message, message
        assert "resume with the same value, or use another --output-dir" in message
    # Another global batch continues at the next sample: accepted.
    assert check_resume(load_job(_config(out, 4, blend_data, mbs=1), 1), out) == "iter_0000002"


def _tokens(dataset, indices):
    return [dataset[i]["tokens"].tolist() for i in indices]


@pytest.mark.parametrize("data", ["plain", "blend"])
def test_datasets_agree_at_every_length_and_global_batch(tmp_path, data, blend_data):
    """build_datasets for 4 steps of 8 samples, for 10 steps of 8, and after 32 consumed samples for 10 steps of 4:
    sample k is the same in all of them, each is long enough, and the validation sets are equal."""
    data = PLAIN if data == "plain" else blend_data
    out = str(tmp_path / "run")
    short_train, short_valid = build_datasets(load_job(_config(out, 4, data), 1), 8, 2)
    long_train, long_valid = build_datasets(load_job(_config(out, 10, data), 1), 8, 2)
    resized_train, _ = build_datasets(load_job(_config(out, 10, data, mbs=1), 1), 4, 2, consumed_samples=32)
    assert (len(short_train), len(long_train), len(resized_train)) == (32, 80, 72)
    assert _tokens(short_train, range(32)) == _tokens(long_train, range(32)) == _tokens(resized_train, range(32))
    assert _tokens(long_train, range(32, 72)) == _tokens(resized_train, range(32, 72))
    assert _tokens(short_valid, range(len(short_valid))) == _tokens(long_valid, range(len(long_valid)))
