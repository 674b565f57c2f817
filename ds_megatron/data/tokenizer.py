"""Tokenizers that turn text into the token ids stored in ``.bin`` files.

The default is a byte-level tokenizer: every UTF-8 byte is its own token and
one extra id marks the end of a document.  It needs no vocabulary file and no
download, so every machine can preprocess and train with it; a real BPE
tokenizer plugs in behind ``build_tokenizer`` with the same four members
(``vocab_size``, ``eod``, ``tokenize``, ``detokenize``).
"""
from __future__ import annotations

from typing import Iterable, List

TOKENIZERS = ("byte",)


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


def build_tokenizer(name: str = "byte") -> ByteTokenizer:
    """The tokenizer named ``name`` (the ``tokenizer`` field / ``--tokenizer`` flag)."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer {name!r} is unknown; set the tokenizer field (--tokenizer) "
                     f"to one of: {', '.join(TOKENIZERS)}")
