"""ByteTokenizer round trips and the tokenizer factory's errors."""
import pytest

from ds_megatron.data.tokenizer import ByteTokenizer, build_tokenizer


@pytest.mark.parametrize("text", ["", "hello world", "naïve café – 東京 🚀", "tab\tnew\nline\x00"])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text


def test_eod_is_outside_bytes_and_dropped_on_detokenize():
    tok = ByteTokenizer()
    assert tok.eod == 256 and tok.vocab_size == 257
    assert tok.detokenize(tok.tokenize("ab") + [tok.eod] + tok.tokenize("ü")) == "abü"


def test_broken_utf8_is_replaced():
    tok = ByteTokenizer()
    ids = tok.tokenize("é")[:1] + tok.tokenize("x")
    assert tok.detokenize(ids) == "\ufffdx"


def test_out_of_vocab_id_is_an_error():
    with pytest.raises(ValueError, match="257"):
        ByteTokenizer().detokenize([65, 257])


def test_factory():
    assert isinstance(build_tokenizer(), ByteTokenizer)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match=r"tokenizer='gpt2' does not exist; give \"byte\""):
        build_tokenizer("gpt2")
