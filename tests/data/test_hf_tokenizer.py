"""Hugging Face tokenizers (tokenizer.json or a transformers directory): ids, EOD, errors naming the field."""
import json
import os

import pytest
from tokenizers import Tokenizer

import bpe_tokenizer
from ds_megatron.config import ConfigError, DataConfig
from ds_megatron.data.indexed_dataset import IndexedDataset, max_token_id
from ds_megatron.data.preprocess import main, preprocess
from ds_megatron.data.tokenizer import HuggingFaceTokenizer, build_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "naïve café – 東京 🚀", "class A:\n    pass"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_tokenizer.train_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=400, max_bytes=100_000)


@pytest.mark.parametrize("as_file", [False, True])
def test_ids_equal_the_tokenizers_library(bpe, as_file):
    reference = Tokenizer.from_file(os.path.join(bpe, "tokenizer.json"))
    tok = build_tokenizer(os.path.join(bpe, "tokenizer.json") if as_file else bpe)
    assert isinstance(tok, HuggingFaceTokenizer)
    for text in TEXTS:
        assert tok.tokenize(text) == reference.encode(text).ids
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == reference.token_to_id(bpe_tokenizer.EOS)
    assert tok.vocab_size == reference.get_vocab_size() == 400


def test_preprocess_appends_eod_with_any_worker_count(bpe, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    reference = Tokenizer.from_file(os.path.join(bpe, "tokenizer.json"))
    eod = reference.token_to_id(bpe_tokenizer.EOS)
    expected = [reference.encode(t).ids + [eod] for t in TEXTS]
    for workers in (1, 2):
        prefix = str(tmp_path / f"out{workers}")
        preprocess(str(src), prefix, tokenizer=bpe, workers=workers)
        ds = IndexedDataset(prefix)
        assert [ds[i].tolist() for i in range(len(ds))] == expected
        assert max_token_id(prefix) == max(max(d) for d in expected)
    # --eod-token picks another token; uint16 holds a 400-token vocabulary.
    preprocess(str(src), str(tmp_path / "other"), tokenizer=bpe, eod_token="A")
    ds = IndexedDataset(str(tmp_path / "other"))
    assert ds[0].tolist()[-1] == reference.token_to_id("A") and ds[0].dtype.itemsize == 2


def test_a_tokenizer_without_eos_needs_eod_token(tmp_path, bpe):
    bare = tmp_path / "bare.json"
    bare.write_bytes(open(os.path.join(bpe, "tokenizer.json"), "rb").read())
    with pytest.raises(ValueError, match=r"--tokenizer=.*names no end-of-document token.*set --eod-token"):
        build_tokenizer(str(bare), field="--tokenizer", eod_field="--eod-token")
    assert build_tokenizer(str(bare), bpe_tokenizer.EOS).eod == 0
    with pytest.raises(ValueError, match=r"eod_token='<nope>' is not a token"):
        build_tokenizer(str(bare), "<nope>")
    src = tmp_path / "a.txt"
    src.write_text("x = 1\n")
    with pytest.raises(SystemExit, match=r"error: --tokenizer=.*names no end-of-document token.*--eod-token"):
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(bare)])
    assert not os.path.exists(tmp_path / "o.bin")


def test_bad_paths_are_refused_naming_the_field(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("x = 1\n")
    with pytest.raises(SystemExit, match=r"--tokenizer='.*missing' does not exist"):
        main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match=r"megatron.data.tokenizer='.*' is a directory without tokenizer.json"):
        DataConfig(tokenizer=str(tmp_path))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match=r"megatron.data.tokenizer='.*tokenizer.json': .* is not a readable"):
        DataConfig(tokenizer=str(broken))
    with pytest.raises(ConfigError, match=r"megatron.data.eod_token='</s>' is set but the byte tokenizer"):
        DataConfig(eod_token="</s>")


def test_vocab_check_uses_the_tokenizers_size(bpe, tmp_path):
    DataConfig(tokenizer=bpe).check_vocab(400)
    with pytest.raises(ConfigError, match=r"megatron.data.tokenizer='.*' has 400 token ids but "
                                          r"megatron.model.vocab_size=399; set vocab_size to at least 400"):
        DataConfig(tokenizer=bpe).check_vocab(399)
    # A dataset made with it is checked by its largest id as well.
    src = tmp_path / "a.txt"
    src.write_text("x = 1\n")
    preprocess(str(src), str(tmp_path / "d"), tokenizer=bpe)
    config = DataConfig(data_path=str(tmp_path / "d"), tokenizer=bpe)
    config.check_vocab(400)
    with pytest.raises(ConfigError, match="has 400 token ids"):
        config.check_vocab(300)


def test_export_files_load_with_auto_tokenizer(bpe, tmp_path):
    """A bare tokenizer.json (EOD given) gets a tokenizer_config.json that transformers loads as the same tokenizer."""
    import transformers
    from ds_megatron.data.tokenizer import hf_tokenizer_export_files
    bare = tmp_path / "bare.json"
    bare.write_bytes(open(os.path.join(bpe, "tokenizer.json"), "rb").read())
    out = tmp_path / "export"
    out.mkdir()
    for name, data in hf_tokenizer_export_files(str(bare), bpe_tokenizer.EOS).items():
        (out / name).write_bytes(data)
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert loaded.eos_token == bpe_tokenizer.EOS
    for text in TEXTS:
        assert loaded(text).input_ids == build_tokenizer(str(bare), bpe_tokenizer.EOS).tokenize(text)
    assert hf_tokenizer_export_files("byte") == {}


def test_megatron_spelling(bpe, tmp_path, capsys):
    """tokenizer_type "HuggingFaceTokenizer" + tokenizer_model (Megatron's names) mean tokenizer: PATH."""
    config = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe)
    assert config.tokenizer == bpe and config.build_tokenizer().vocab_size == 400
    with pytest.raises(ConfigError, match=r"megatron.data.tokenizer and megatron.data.tokenizer_type / "
                                          r"tokenizer_model are both set"):
        DataConfig(tokenizer=bpe, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe)
    with pytest.raises(ConfigError, match=r"megatron.data.tokenizer_type='GPT2BPETokenizer' with tokenizer_model"):
        DataConfig(tokenizer_type="GPT2BPETokenizer", tokenizer_model=bpe)
    src = tmp_path / "a.txt"
    src.write_text("x = 1\n")
    assert main(["--input", str(src), "--output-prefix", str(tmp_path / "m"), "--tokenizer-type",
                 "HuggingFaceTokenizer", "--tokenizer-model", bpe]) == 0
    reference = Tokenizer.from_file(os.path.join(bpe, "tokenizer.json"))
    assert IndexedDataset(str(tmp_path / "m"))[0].tolist() == reference.encode("x = 1\n").ids + [0]
    with pytest.raises(SystemExit):
        main(["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type", "HuggingFaceTokenizer"])
    assert "needs --tokenizer-model PATH" in capsys.readouterr().err
