"""``ds-megatron preprocess``: turn a text corpus into a ``.bin``/``.idx`` dataset.

Inputs, chosen by file extension:

``.txt``
    The whole file is one document.  With ``split_lines=True``
    (``--split-lines``) every non-blank line is its own document instead.
``.jsonl``
    One JSON object per line, the text under ``json_key`` (``--json-key``,
    default ``text``).  Blank lines are skipped.

Each document is tokenized, followed by the tokenizer's end-of-document id
unless ``append_eod=False``; documents without any token are skipped.  The
output is written atomically: an input error half way leaves no files under
the output prefix (and keeps an older dataset there intact).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from .indexed_dataset import IndexedDatasetBuilder, best_dtype
from .tokenizer import TOKENIZERS, build_tokenizer

INPUT_EXTENSIONS = (".txt", ".jsonl")


@dataclass(frozen=True)
class PreprocessStats:
    output_prefix: str
    num_documents: int
    num_tokens: int


def _check_input(input_path: str) -> str:
    if not os.path.isfile(input_path):
        what = "is a directory" if os.path.isdir(input_path) else "does not exist"
        raise FileNotFoundError(f"--input {input_path!r} {what}; pass an existing .txt or .jsonl file")
    ext = os.path.splitext(input_path)[1].lower()
    if ext not in INPUT_EXTENSIONS:
        raise ValueError(f"--input {input_path!r} has extension {ext or '(none)'!r}; use a .txt file "
                         f"(plain text) or a .jsonl file (one JSON object per line)")
    return ext


def _read_lines(input_path: str) -> Iterator[tuple]:
    """(line number, line) pairs; undecodable bytes are an error naming the line."""
    with open(input_path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"--input {input_path!r} line {lineno} is not valid UTF-8 ({e.reason} "
                                 f"at byte {e.start}); re-encode the file as UTF-8") from None


def iter_documents(input_path: str, json_key: str = "text", split_lines: bool = False) -> Iterator[str]:
    """The documents of ``input_path`` as text, in file order (rules in the module docstring)."""
    ext = _check_input(input_path)
    if ext == ".txt":
        if split_lines:
            for _, line in _read_lines(input_path):
                if line.strip():
                    yield line.rstrip("\r\n")
        else:
            yield "".join(line for _, line in _read_lines(input_path))
        return
    for lineno, line in _read_lines(input_path):
        if not line.strip():
            continue
        where = f"--input {input_path!r} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg}); fix the line or pass a .jsonl "
                             f"file with one JSON object per line") from None
        if not isinstance(record, dict) or json_key not in record:
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where} has no key {json_key!r} (found: {keys}); pass --json-key with "
                             f"the field that holds the text")
        text = record[json_key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: --json-key {json_key!r} holds a {type(text).__name__}, not a "
                             f"string; pass --json-key with the field that holds the text")
        yield text


def preprocess(input_path: str, output_prefix: str, tokenizer: str = "byte", json_key: str = "text",
               append_eod: bool = True, split_lines: bool = False) -> PreprocessStats:
    """Tokenize ``input_path`` into ``output_prefix.bin`` / ``output_prefix.idx``."""
    tok = build_tokenizer(tokenizer)
    _check_input(input_path)
    num_documents = num_tokens = 0
    with IndexedDatasetBuilder(output_prefix, best_dtype(tok.vocab_size)) as builder:
        for text in iter_documents(input_path, json_key=json_key, split_lines=split_lines):
            ids = tok.tokenize(text)
            if not ids:
                continue
            if append_eod:
                ids.append(tok.eod)
            builder.add_document(ids)
            num_documents += 1
            num_tokens += len(ids)
    return PreprocessStats(output_prefix, num_documents, num_tokens)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-megatron preprocess",
        description="Tokenize a .txt or .jsonl corpus into a Megatron .bin/.idx dataset.")
    p.add_argument("--input", required=True, help="a .txt file (one document) or .jsonl file "
                   "(one JSON object per line)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZERS)
    p.add_argument("--json-key", default="text", help="field of each .jsonl object that holds the text")
    p.add_argument("--split-lines", action="store_true", help=".txt only: every non-blank line "
                   "is a document")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not end each document with the end-of-document token")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of ``ds-megatron preprocess``; ``argv`` are the arguments after ``preprocess``."""
    args = build_parser().parse_args(argv)
    try:
        stats = preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer,
                           json_key=args.json_key, append_eod=args.append_eod,
                           split_lines=args.split_lines)
    except (ValueError, OSError) as e:
        raise SystemExit(f"ds-megatron preprocess: error: {e}") from None
    print(f"wrote {stats.output_prefix}.bin/.idx: {stats.num_documents} documents, "
          f"{stats.num_tokens} tokens")
    return 0

