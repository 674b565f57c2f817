"""``ds-megatron preprocess``: turn a text corpus into a ``.bin``/``.idx`` dataset.

Inputs, chosen by file extension:

``.txt``
    The whole file is one document.  With ``split_lines=True``
    (``--split-lines``) every non-blank line is its own document instead.
``.jsonl``, ``.jsonl.gz``
    One JSON object per line, the text under ``json_key`` (``--json-key``,
    default ``text``).  Blank lines are skipped.  With ``json_keys``
    (Megatron's ``--json-keys a b``) each key is a dataset of its own, written
    as Megatron's ``preprocess_data.py`` names it: ``PREFIX_<key>_document``.

Each document is tokenized (``tokenizer``: ``"byte"`` or a Hugging Face
``tokenizer.json`` / tokenizer directory, see ``data/tokenizer.py``), followed by
the tokenizer's end-of-document id unless ``append_eod=False``; documents without any token are skipped (per key).
``workers > 1`` tokenizes in that many processes; documents keep their file
order, so the output is byte-identical to one worker's.  The output is written
atomically: an input error half way leaves no files under the output prefix
(and keeps an older dataset there intact), with any number of keys or workers.

``--sft`` (``preprocess_sft``) reads chat rows instead, from ``.jsonl``,
``.jsonl.gz``, ``.parquet`` files and directories written by ``datasets``'
``save_to_disk``, one or more ``--input``, and writes a packed SFT dataset
(``data/sft.py``: what is trained, the packing, the files).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from .indexed_dataset import IndexedDatasetBuilder, best_dtype
from .sft import TRUNCATIONS, SFTStats, build_packed_sft
from .tokenizer import build_tokenizer
from .workers import encoded_in_order

INPUT_EXTENSIONS = (".txt", ".jsonl", ".jsonl.gz")
SFT_INPUT_EXTENSIONS = (".jsonl", ".jsonl.gz", ".parquet")
_CHUNK = 64  # lines handed to a worker at a time (Megatron's pool uses 32-100)


@dataclass(frozen=True)
class PreprocessStats:
    output_prefix: str
    num_documents: int
    num_tokens: int


def _extension(input_path: str) -> str:
    lower = input_path.lower()
    return next((ext for ext in INPUT_EXTENSIONS if lower.endswith(ext)), os.path.splitext(lower)[1])


def _check_input(input_path: str) -> str:
    if not os.path.isfile(input_path):
        what = "is a directory" if os.path.isdir(input_path) else "does not exist"
        raise FileNotFoundError(f"--input {input_path!r} {what}; pass an existing .txt, .jsonl or .jsonl.gz file")
    ext = _extension(input_path)
    if ext not in INPUT_EXTENSIONS:
        raise ValueError(f"--input {input_path!r} has extension {ext or '(none)'!r}; use a .txt file "
                         f"(plain text) or a .jsonl / .jsonl.gz file (one JSON object per line)")
    return ext


def _read_lines(input_path: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) pairs; undecodable bytes are an error naming the line."""
    opener = gzip.open if input_path.lower().endswith(".gz") else open
    with opener(input_path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"--input {input_path!r} line {lineno} is not valid UTF-8 ({e.reason} "
                                 f"at byte {e.start}); re-encode the file as UTF-8") from None


def _json_texts(input_path: str, lineno: int, line: str, keys: Sequence[str], flag: str) -> List[str]:
    """The texts under ``keys`` of one .jsonl line (errors name the line and ``flag``)."""
    where = f"--input {input_path!r} line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg}); fix the line or pass a .jsonl "
                         f"file with one JSON object per line") from None
    texts = []
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            found = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where} has no key {key!r} (found: {found}); pass {flag} with "
                             f"the field that holds the text")
        text = record[key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: {flag} {key!r} holds a {type(text).__name__}, not a "
                             f"string; pass {flag} with the field that holds the text")
        texts.append(text)
    return texts


def _units(input_path: str, split_lines: bool) -> Iterator[Tuple[int, str]]:
    """What one worker task turns into documents: a .jsonl line, a .txt line, or a whole .txt file."""
    if _check_input(input_path) != ".txt":
        return ((n, line) for n, line in _read_lines(input_path) if line.strip())
    if split_lines:
        return ((n, line.rstrip("\r\n")) for n, line in _read_lines(input_path) if line.strip())
    return iter([(1, "".join(line for _, line in _read_lines(input_path)))])


def iter_documents(input_path: str, json_key: str = "text", split_lines: bool = False) -> Iterator[str]:
    """The documents of ``input_path`` as text, in file order (rules in the module docstring)."""
    is_json = _check_input(input_path) != ".txt"
    for lineno, unit in _units(input_path, split_lines):
        yield _json_texts(input_path, lineno, unit, [json_key], "--json-key")[0] if is_json else unit


class _Encoder:
    """Texts -> token ids, the same in the main process and in every worker."""

    def __init__(self, input_path: str, keys: Optional[Sequence[str]], flag: str, tokenizer: str,
                 eod_token: Optional[str], append_eod: bool):
        self.input_path, self.keys, self.flag = input_path, keys, flag
        self.tokenizer, self.eod_token, self.append_eod = tokenizer, eod_token, append_eod
        self._tok = None

    def __call__(self, unit: Tuple[int, str]):
        """``(ids per key, None)`` or ``(None, error message)``: the error is raised in file order."""
        if self._tok is None:
            self._tok = _build(self.tokenizer, self.eod_token)
        lineno, text = unit
        try:
            texts = [text] if self.keys is None else _json_texts(self.input_path, lineno, text, self.keys, self.flag)
        except ValueError as e:
            return None, str(e)
        out = []
        for t in texts:
            ids = self._tok.tokenize(t)
            if ids and self.append_eod:
                ids.append(self._tok.eod)
            out.append(ids)
        return out, None


def _build(tokenizer: str, eod_token: Optional[str]):
    return build_tokenizer(tokenizer, eod_token, field="--tokenizer", eod_field="--eod-token")


def output_prefixes(output_prefix: str, json_keys: Sequence[str]) -> List[str]:
    """Megatron's ``preprocess_data.py`` names: ``PREFIX_<key>_document`` per key."""
    return [f"{output_prefix}_{key}_document" for key in json_keys]


def preprocess_keys(input_path: str, output_prefix: str, json_keys: Optional[Sequence[str]] = None,
                    tokenizer: str = "byte", json_key: str = "text", append_eod: bool = True,
                    split_lines: bool = False, workers: int = 1, eod_token: Optional[str] = None
                    ) -> List[PreprocessStats]:
    """Tokenize ``input_path`` into one dataset per key (``json_keys``), or one at ``output_prefix``."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: give 1 or more processes")
    ext = _check_input(input_path)
    if json_keys is not None:
        if not json_keys or len(set(json_keys)) != len(json_keys):
            raise ValueError(f"--json-keys {' '.join(json_keys)!r}: give one or more distinct keys")
        if ext == ".txt":
            raise ValueError(f"--json-keys needs a .jsonl or .jsonl.gz input, got {input_path!r}")
    keys, flag = (list(json_keys), "--json-keys") if json_keys is not None else ([json_key], "--json-key")
    prefixes = output_prefixes(output_prefix, keys) if json_keys is not None else [output_prefix]
    # Built here first: a bad tokenizer path fails before any worker starts or file is opened.
    dtype = best_dtype(_build(tokenizer, eod_token).vocab_size)
    encoder = _Encoder(input_path, None if ext == ".txt" else keys, flag, tokenizer, eod_token, append_eod)
    counts = [[0, 0] for _ in prefixes]
    with contextlib.ExitStack() as stack:
        builders = [stack.enter_context(IndexedDatasetBuilder(p, dtype)) for p in prefixes]
        for ids_per_key in encoded_in_order(encoder, _units(input_path, split_lines), workers, _CHUNK, stack):
            for builder, count, ids in zip(builders, counts, ids_per_key):
                if ids:
                    builder.add_document(ids)
                    count[0] += 1
                    count[1] += len(ids)
    return [PreprocessStats(p, docs, tokens) for p, (docs, tokens) in zip(prefixes, counts)]


def preprocess(input_path: str, output_prefix: str, tokenizer: str = "byte", json_key: str = "text",
               append_eod: bool = True, split_lines: bool = False, workers: int = 1,
               eod_token: Optional[str] = None) -> PreprocessStats:
    """Tokenize ``input_path`` into ``output_prefix.bin`` / ``output_prefix.idx``."""
    return preprocess_keys(input_path, output_prefix, None, tokenizer, json_key, append_eod, split_lines, workers,
                           eod_token)[0]


def _sft_input_kind(input_path: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"datasets"`` (a ``save_to_disk`` directory); errors name the fix."""
    if os.path.isdir(input_path):
        if os.path.isfile(os.path.join(input_path, "dataset_dict.json")):
            splits = ", ".join(sorted(d for d in os.listdir(input_path)
                                      if os.path.isdir(os.path.join(input_path, d))))
            raise ValueError(f"--input {input_path!r} holds several splits ({splits}); pass the directory of "
                             f"one split, such as {os.path.join(input_path, 'train')!r}")
        if not os.path.isfile(os.path.join(input_path, "state.json")):
            raise ValueError(f"--input {input_path!r} is a directory without state.json, not one written by "
                             "datasets' save_to_disk; pass such a directory or a .jsonl / .parquet file")
        return "datasets"
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path!r} does not exist; pass a .jsonl, .jsonl.gz or .parquet "
                                "file or a datasets save_to_disk directory")
    lower = input_path.lower()
    ext = next((e for e in SFT_INPUT_EXTENSIONS if lower.endswith(e)), os.path.splitext(lower)[1])
    if ext not in SFT_INPUT_EXTENSIONS:
        raise ValueError(f"--input {input_path!r} has extension {ext or '(none)'!r}; --sft reads .jsonl, "
                         ".jsonl.gz and .parquet files and datasets save_to_disk directories")
    return "parquet" if ext == ".parquet" else "jsonl"


def _datasets():
    try:
        # Imported here: only parquet files and datasets directories need it, an optional dependency.
        import datasets
    except ImportError:
        raise ValueError("reading .parquet files and datasets directories needs the datasets library; "
                         "pip install 'ds-megatron[sft]' (transformers and datasets)") from None
    return datasets


def iter_sft_rows(input_path: str) -> Iterator[Tuple[str, Union[str, dict]]]:
    """``(where, row)`` of each row of ``input_path`` in order: ``where`` names the file and the line (.jsonl, a
    JSON line as ``row``) or the row number from 0 (parquet, datasets directory, a dict as ``row``)."""
    kind = _sft_input_kind(input_path)
    if kind == "jsonl":
        for lineno, line in _read_lines(input_path):
            if line.strip():
                yield f"--input {input_path!r} line {lineno}", line
        return
    if kind == "parquet":
        # Streaming reads the file where it is: no copy into the datasets cache.
        rows = _datasets().load_dataset("parquet", data_files=input_path, split="train", streaming=True)
    else:
        rows = _datasets().load_from_disk(input_path)
    for i, row in enumerate(rows):
        yield f"--input {input_path!r} row {i}", row


def preprocess_sft(inputs: Union[str, Sequence[str]], output_prefix: str, tokenizer: str, seq_length: int,
                   max_length: Optional[int] = None, truncation: str = "right", workers: int = 1,
                   seed: int = 1234) -> SFTStats:
    """Encode, pack and write the rows of ``inputs`` (in order) as a packed SFT dataset at ``output_prefix``."""
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    for path in inputs:
        _sft_input_kind(path)  # every input checked before the first is read
    units = (unit for path in inputs for unit in iter_sft_rows(path))
    return build_packed_sft(units, output_prefix, tokenizer, seq_length, max_length, truncation, workers, seed,
                            sources=inputs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-megatron preprocess",
        description="Tokenize a .txt, .jsonl or .jsonl.gz corpus into a Megatron .bin/.idx dataset, or (--sft) "
                    "chat rows into a packed SFT dataset.")
    p.add_argument("--input", required=True, action="append", help="a .txt file (one document) or a .jsonl / "
                   ".jsonl.gz file (one JSON object per line); with --sft also .parquet files and datasets "
                   "save_to_disk directories, and the flag may repeat")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (with --json-keys: "
                   "PREFIX_<key>_document.bin/.idx per key, as Megatron's preprocess_data.py)")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default="byte",
                   help="\"byte\" (default), or a Hugging Face tokenizer.json file or transformers tokenizer "
                        "directory (Megatron's --tokenizer-model of HuggingFaceTokenizer)")
    p.add_argument("--tokenizer-type", choices=("HuggingFaceTokenizer",), help="Megatron's flag, accepted "
                   "with --tokenizer-model PATH (the same as --tokenizer PATH)")
    p.add_argument("--eod-token", default=None, help="the token that ends a document (default: the eos_token of "
                   "the tokenizer_config.json beside tokenizer.json)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--json-key", default=None, help="field of each .jsonl object that holds the text "
                      "(default: text)")
    keys.add_argument("--json-keys", nargs="+", default=None, help="Megatron's flag: one dataset per field")
    p.add_argument("--split-lines", action="store_true", help=".txt only: every non-blank line "
                   "is a document")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (the output does not depend on it)")
    eod = p.add_mutually_exclusive_group()
    eod.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                     help="end each document with the end-of-document token (the default here; Megatron's "
                          "preprocess_data.py appends it only with this flag)")
    eod.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                     help="do not end each document with the end-of-document token")
    sft = p.add_argument_group("SFT", "--sft: chat rows (messages, prompt / completion or text) into a packed "
                               "dataset, loss on the assistant / completion tokens only")
    sft.add_argument("--sft", action="store_true", help="write a packed SFT dataset (--tokenizer DIR with a chat "
                     "template, --seq-length S)")
    sft.add_argument("--seq-length", type=int, default=None, help="tokens per packed row: the seq_length of the "
                     "training job (the dataset trains only at it)")
    sft.add_argument("--max-length", type=int, default=None, help="longest conversation kept whole (default and "
                     "at most: --seq-length)")
    sft.add_argument("--truncation", choices=TRUNCATIONS, default=None, help="a longer conversation: right keeps "
                     "its first --max-length tokens (the default), drop leaves it out; both are counted")
    sft.add_argument("--seed", type=int, default=None, help="order of equal-length conversations in the packing "
                     "(default 1234)")
    return p


_SFT_ONLY = ("seq_length", "max_length", "truncation", "seed")


def _main_sft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    unused = [flag for flag, given in (("--json-key", args.json_key is not None),
                                       ("--json-keys", args.json_keys is not None),
                                       ("--split-lines", args.split_lines), ("--eod-token", args.eod_token),
                                       ("--no-append-eod", not args.append_eod)) if given]
    if unused:
        parser.error(f"{', '.join(unused)} do(es) not apply to --sft; remove it")
    if args.tokenizer == "byte":
        parser.error("--sft needs --tokenizer DIR, a transformers tokenizer directory (with a chat template for "
                     "'messages' rows)")
    if args.seq_length is None:
        parser.error("--sft needs --seq-length S, the seq_length of the training job")
    try:
        stats = preprocess_sft(args.input, args.output_prefix, args.tokenizer, args.seq_length,
                               max_length=args.max_length, truncation=args.truncation or "right",
                               workers=args.workers, seed=1234 if args.seed is None else args.seed)
    except (ValueError, OSError) as e:
        raise SystemExit(f"ds-megatron preprocess: error: {e}") from None
    if stats.untrained:
        print(f"ds-megatron preprocess: {stats.untrained} conversation(s) had no token to train and were left out "
              f"(first: {'; '.join(stats.untrained_where)})", file=sys.stderr)
    print(f"wrote {args.output_prefix}.bin/.idx, .trained.bin/.idx and .sft.json: {stats.documents} conversations "
          f"in {stats.packed_rows} rows of {args.seq_length} tokens")
    print(json.dumps(stats.as_dict()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of ``ds-megatron preprocess``; ``argv`` are the arguments after ``preprocess``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sft:
        return _main_sft(parser, args)
    given = [f"--{name.replace('_', '-')}" for name in _SFT_ONLY if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)} apply only with --sft")
    if len(args.input) > 1:
        parser.error(f"--input is given {len(args.input)} times; give one file (several only with --sft)")
    if args.tokenizer_type is not None and args.tokenizer == "byte":
        parser.error("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (a tokenizer.json file "
                     "or a transformers tokenizer directory)")
    try:
        all_stats = preprocess_keys(args.input[0], args.output_prefix, json_keys=args.json_keys,
                                    tokenizer=args.tokenizer, json_key=args.json_key or "text",
                                    append_eod=args.append_eod,
                                    split_lines=args.split_lines, workers=args.workers,
                                    eod_token=args.eod_token)
    except (ValueError, OSError) as e:
        raise SystemExit(f"ds-megatron preprocess: error: {e}") from None
    for stats in all_stats:
        print(f"wrote {stats.output_prefix}.bin/.idx: {stats.num_documents} documents, "
              f"{stats.num_tokens} tokens")
    return 0
