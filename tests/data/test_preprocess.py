"""preprocess(): .txt and .jsonl into .bin/.idx, and one-line errors that name the flag."""
import json
import os

import pytest

from ds_megatron.data.indexed_dataset import IndexedDataset
from ds_megatron.data.preprocess import main, preprocess
from ds_megatron.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _docs(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _expect(*texts, eod=True):
    return [TOK.tokenize(t) + ([TOK.eod] if eod else []) for t in texts]


def test_txt_is_one_document(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("first line\n\nsecond ü\n", encoding="utf-8")
    stats = preprocess(str(src), str(tmp_path / "out"))
    assert _docs(str(tmp_path / "out")) == _expect("first line\n\nsecond ü\n")
    assert (stats.num_documents, stats.num_tokens) == (1, len(_expect("first line\n\nsecond ü\n")[0]))


def test_txt_split_lines(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("one\n\n  \ntwo\r\nthree", encoding="utf-8")
    preprocess(str(src), str(tmp_path / "out"), split_lines=True, append_eod=False)
    assert _docs(str(tmp_path / "out")) == _expect("one", "two", "three", eod=False)


def test_jsonl(tmp_path):
    src = tmp_path / "a.jsonl"
    rows = [{"text": "héllo", "id": 1}, {"text": ""}, {"text": "wörld 🚀"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    stats = preprocess(str(src), str(tmp_path / "out"))
    assert _docs(str(tmp_path / "out")) == _expect("héllo", "wörld 🚀")  # empty docs are skipped
    assert stats.num_documents == 2


def test_jsonl_custom_key(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"content": "abc"}) + "\n", encoding="utf-8")
    main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--json-key", "content"])
    assert _docs(str(tmp_path / "out")) == _expect("abc")


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--input .*nope\.txt.* does not exist"):
        preprocess(str(tmp_path / "nope.txt"), str(tmp_path / "out"))


def test_bad_extension(tmp_path):
    src = tmp_path / "a.csv"
    src.write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--input .*'\.csv'.*\.txt.*\.jsonl"):
        preprocess(str(src), str(tmp_path / "out"))


def test_bad_json_line_names_line_and_leaves_no_output(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--input .* line 2 is not valid JSON"):
        preprocess(str(src), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == ["a.jsonl"]


def test_missing_key_names_json_key_flag(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1 has no key 'text' \(found: body\); pass --json-key"):
        preprocess(str(src), str(tmp_path / "out"))
    src.write_text('{"text": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--json-key 'text' holds a int"):
        preprocess(str(src), str(tmp_path / "out"))


def test_invalid_utf8_names_line(tmp_path):
    src = tmp_path / "a.txt"
    src.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"line 2 is not valid UTF-8"):
        preprocess(str(src), str(tmp_path / "out"))


def test_main_turns_errors_into_one_line_exit(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "out")])
    msg = str(e.value.code)
    assert msg.startswith("ds-megatron preprocess: error: --input ") and "\n" not in msg


def test_main_success_prints_summary(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("abc", encoding="utf-8")
    assert main(["--input", str(src), "--output-prefix", str(tmp_path / "sub" / "out")]) == 0
    assert "1 documents, 4 tokens" in capsys.readouterr().out
    assert _docs(str(tmp_path / "sub" / "out")) == _expect("abc")


def _bytes(prefix):
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")]


def _corpus(n=400):
    # Enough lines for several worker chunks, with empty texts (skipped per key) and non-ASCII.
    return [{"text": f"doc {i} " + "ü" * (i % 7), "title": "" if i % 5 == 0 else f"t{i}", "id": i}
            for i in range(n)]


def test_json_keys_gz_and_workers_match_one_worker_byte_for_byte(tmp_path):
    import gzip
    rows = _corpus()
    src = tmp_path / "a.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    out = str(tmp_path / "multi")
    assert main(["--input", str(src), "--output-prefix", out, "--json-keys", "text", "title", "--workers", "3",
                 "--append-eod"]) == 0
    for key in ("text", "title"):
        # Megatron's preprocess_data.py names, and the documents a plain tokenizer gives.
        assert _docs(f"{out}_{key}_document") == _expect(*(r[key] for r in rows if r[key]))
        single = str(tmp_path / f"single_{key}")
        preprocess(str(src), single, json_key=key, workers=1)
        assert _bytes(f"{out}_{key}_document") == _bytes(single)


def test_txt_split_lines_with_workers_is_byte_identical(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("\n".join(f"line {i}" if i % 9 else "" for i in range(300)), encoding="utf-8")
    preprocess(str(src), str(tmp_path / "one"), split_lines=True, workers=1)
    preprocess(str(src), str(tmp_path / "two"), split_lines=True, workers=2)
    assert _bytes(str(tmp_path / "one")) == _bytes(str(tmp_path / "two"))
    assert len(_docs(str(tmp_path / "one"))) == 300 - 34


def test_error_with_workers_names_the_line_and_writes_nothing(tmp_path):
    rows = [json.dumps(r) for r in _corpus(200)]
    rows[150] = '{"text": "x"}'  # no "title"
    src = tmp_path / "a.jsonl"
    src.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 151 has no key 'title' \(found: text\); pass --json-keys"):
        from ds_megatron.data.preprocess import preprocess_keys
        preprocess_keys(str(src), str(tmp_path / "out"), json_keys=["text", "title"], workers=2)
    assert os.listdir(tmp_path) == ["a.jsonl"]


def test_json_key_flags_exclusive_and_keys_need_jsonl(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("abc", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-key", "a", "--json-keys", "b"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "text"])
    assert "--json-keys needs a .jsonl or .jsonl.gz input" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "0"])
    assert "--workers 0" in str(e.value.code)
