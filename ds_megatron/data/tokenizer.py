"""Tokenizers that turn text into the token ids stored in ``.bin`` files.

``build_tokenizer(name)`` gives one of two kinds, both with the same four
members (``vocab_size``, ``eod``, ``tokenize``, ``detokenize``):

``"byte"``
    Every UTF-8 byte is its own token and id 256 ends a document.  It needs no
    vocabulary file, so every machine can preprocess and train with it.
a path
    A Hugging Face tokenizer (Megatron's ``HuggingFaceTokenizer``): a
    ``tokenizer.json`` file, or a ``transformers`` tokenizer directory holding
    one.  Text is encoded by the ``tokenizers`` library itself (its
    post-processor included, as Megatron's ``tokenizer(text).input_ids``), with
    no ``transformers`` import.  The end-of-document id is the token named
    ``eod_token`` if given, else the ``eos_token`` of the ``tokenizer_config.json``
    beside the ``tokenizer.json``; a tokenizer with neither is refused.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

TOKENIZERS = ("byte", "a tokenizer.json file", "a transformers tokenizer directory")
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
# What a transformers tokenizer directory may hold besides tokenizer.json; copied along on export.
HF_TOKENIZER_SIDE_FILES = (HF_TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json")


class ByteTokenizer:
    """Ids 0..255 are the bytes of the UTF-8 text; id 256 is end-of-document."""

    NUM_BYTES = 256

    def __init__(self):
        self._eod = self.NUM_BYTES

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + 1

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                data.append(i)
            elif not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 f"[0, {self.vocab_size}); pass ids produced by ByteTokenizer")
        return data.decode("utf-8", errors="replace")


def hf_tokenizer_files(path: str, field: str = "tokenizer") -> Tuple[str, Optional[str]]:
    """(the ``tokenizer.json``, the ``tokenizer_config.json`` beside it or None) of a file or directory path."""
    if os.path.isdir(path):
        tokenizer_json = os.path.join(path, HF_TOKENIZER_FILE)
        if not os.path.isfile(tokenizer_json):
            raise ValueError(f"{field}={path!r} is a directory without {HF_TOKENIZER_FILE}; give a transformers "
                             f"tokenizer directory saved by a fast tokenizer, a {HF_TOKENIZER_FILE} file, or \"byte\"")
    elif os.path.isfile(path):
        tokenizer_json = path
    else:
        raise ValueError(f"{field}={path!r} does not exist; give \"byte\", a {HF_TOKENIZER_FILE} file or a "
                         "transformers tokenizer directory")
    config = os.path.join(os.path.dirname(os.path.abspath(tokenizer_json)), HF_TOKENIZER_CONFIG)
    return tokenizer_json, config if os.path.isfile(config) else None


def _token_content(token) -> Optional[str]:
    """``eos_token`` as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    return token.get("content") if isinstance(token, dict) else token


class HuggingFaceTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``; ``eod`` is its end-of-sequence id."""

    def __init__(self, path: str, eod_token: Optional[str] = None, field: str = "tokenizer",
                 eod_field: str = "eod_token"):
        from tokenizers import Tokenizer
        self.path = path
        self.tokenizer_json, self.tokenizer_config = hf_tokenizer_files(path, field)
        try:
            self._tok = Tokenizer.from_file(self.tokenizer_json)
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"{field}={path!r}: {self.tokenizer_json} is not a readable tokenizers file "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); give a tokenizer.json "
                             "saved by the tokenizers library or transformers") from None
        vocab: Dict[str, int] = self._tok.get_vocab(with_added_tokens=True)
        # Added tokens may sit above get_vocab_size(); every id must have a logit.
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        where = eod_field
        if eod_token is None:
            eod_token = self._config_eos()
            where = f"eos_token of {self.tokenizer_config}"
        if eod_token is None:
            raise ValueError(f"{field}={path!r} names no end-of-document token (no eos_token in a "
                             f"{HF_TOKENIZER_CONFIG} beside {HF_TOKENIZER_FILE}); set {eod_field} to the token "
                             "that ends a document, e.g. \"</s>\" or \"<|endoftext|>\"")
        if eod_token not in vocab:
            raise ValueError(f"{where}={eod_token!r} is not a token of {self.tokenizer_json}; set {eod_field} to "
                             "one of its tokens")
        self.eod_token = eod_token
        self._eod = vocab[eod_token]

    def _config_eos(self) -> Optional[str]:
        if self.tokenizer_config is None:
            return None
        try:
            with open(self.tokenizer_config) as f:
                return _token_content(json.load(f).get("eos_token"))
        except (OSError, ValueError, AttributeError):
            raise ValueError(f"{self.tokenizer_config} is not a readable JSON object; fix or remove it") from None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def is_byte(name: str) -> bool:
    return name == "byte"


def build_tokenizer(name: str = "byte", eod_token: Optional[str] = None, field: str = "tokenizer",
                    eod_field: str = "eod_token"):
    """The tokenizer ``name`` names: ``"byte"`` or a Hugging Face tokenizer path (``field`` / ``eod_field``: the
    setting's names in error messages, e.g. ``--tokenizer`` or ``megatron.data.tokenizer``)."""
    if is_byte(name):
        if eod_token is not None:
            raise ValueError(f"{eod_field}={eod_token!r} is set but the byte tokenizer's end-of-document id is "
                             f"always 256; remove {eod_field}")
        return ByteTokenizer()
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}={name!r} is unknown; set it to one of: {', '.join(TOKENIZERS)}")
    return HuggingFaceTokenizer(name, eod_token, field, eod_field)


def tokenizer_key(name: str, eod_token: Optional[str] = None) -> str:
    """A file-name-safe key of a tokenizer's identity (its file's contents), for cache names."""
    if is_byte(name):
        return "byte"
    tokenizer_json, _ = hf_tokenizer_files(name)
    h = hashlib.sha256()
    with open(tokenizer_json, "rb") as f:
        h.update(f.read())
    h.update(repr(build_tokenizer(name, eod_token).eod).encode())
    return "hf-" + h.hexdigest()[:16]


def hf_tokenizer_export_files(name: str, eod_token: Optional[str] = None) -> Dict[str, bytes]:
    """The files a Hugging Face model directory needs for ``AutoTokenizer.from_pretrained`` to load this tokenizer.

    ``tokenizer.json`` and the transformers files beside it; without a ``tokenizer_config.json`` one is written
    (``PreTrainedTokenizerFast`` with this end-of-document token as ``eos_token``), since ``tokenizer.json`` alone
    names neither the class nor the eos token.  Empty for the byte tokenizer (it has no such files)."""
    if is_byte(name):
        return {}
    tok = build_tokenizer(name, eod_token)
    folder = os.path.dirname(os.path.abspath(tok.tokenizer_json))
    out: Dict[str, bytes] = {}
    with open(tok.tokenizer_json, "rb") as f:
        out[HF_TOKENIZER_FILE] = f.read()
    for side in HF_TOKENIZER_SIDE_FILES:
        if os.path.isfile(os.path.join(folder, side)):
            with open(os.path.join(folder, side), "rb") as f:
                out[side] = f.read()
    if HF_TOKENIZER_CONFIG not in out:
        out[HF_TOKENIZER_CONFIG] = json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                               "eos_token": tok.eod_token}, indent=2).encode()
    return out
