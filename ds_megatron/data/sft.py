"""Packed SFT datasets: chat rows into token ids with per-token "trained" flags, packed into rows of S tokens.

``ds-megatron preprocess --sft`` (``preprocess.py`` reads the inputs) hands each input row to ``SFTEncoder``,
packs what it returns with ``best_fit_decreasing`` and writes it with ``build_packed_sft``.

Rows (a JSON object, or a row of a parquet file / ``datasets`` directory; a ``None`` field counts as absent):

``messages``
    a list of ``{"role", "content", ...}`` turns, role one of system / user / assistant / tool (other keys, such
    as ``tool_calls``, and a row's ``tools`` go to the template), rendered with the tokenizer's own chat
    template.  Trained: exactly the tokens ``apply_chat_template(..., return_assistant_tokens_mask=True)``
    marks when the template has ``{% generation %}`` markers; without markers, the tokens each assistant turn
    adds to the conversation rendered up to it with ``add_generation_prompt=True`` (the rendering of every
    prefix must be a prefix of the whole, else the row is refused).  Never all tokens.
``prompt`` / ``completion``
    two strings: the prompt's tokens (with the tokenizer's special tokens) untrained, the completion's and an
    EOS after it trained; or two lists of turns: the conversation ``prompt + completion`` with only the
    completion's assistant tokens trained.
``text``
    every token trained, an EOS appended.

A conversation longer than ``max_length`` tokens keeps its first ``max_length`` (``truncation="right"``) or is
left out (``"drop"``); one with no trained token after its first is left out (``untrained``).  Both are counted.

Packing: best-fit-decreasing into rows of ``seq_length`` tokens, longest conversation first, equal lengths in a
seeded random order; each goes to the open row with the least room that holds it (the first opened among
equals), else opens a row.  It runs on the lengths alone, after every row is encoded, so the output does not
depend on the number of workers.

On disk, for a prefix ``P`` (every file written to a temporary name and renamed; ``P.sft.json`` last):

``P.bin`` / ``P.idx``
    Megatron's indexed dataset (``indexed_dataset.py``): one sequence per conversation, packed row after packed
    row, each row's unused tail one more sequence of pad ids.  Every row is exactly ``seq_length`` tokens, so
    row ``r`` is tokens ``r * S`` to ``(r + 1) * S`` of the ``.bin`` and its sequences are its boundaries.
``P.trained.bin`` / ``P.trained.idx``
    the same sequences, one uint8 flag per token: ``UNTRAINED`` (0), ``TRAINED`` (1), ``PADDING`` (2).
``P.sft.json``
    what makes ``P`` a packed SFT dataset: the format and its version, the ``seq_length`` packed for, the pad
    id, the tokenizer, the settings and the statistics.

Nothing depends on the parallel layout: batches of whole rows train at any TP / PP / CP / DP.
"""
from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype
from .workers import encoded_in_order

ROLES = ("system", "user", "assistant", "tool")
TRUNCATIONS = ("right", "drop")
FORMAT = "ds_megatron packed sft"
FORMAT_VERSION = 1
UNTRAINED, TRAINED, PADDING = 0, 1, 2
_CHUNK = 16  # rows handed to a worker at a time (a conversation is rendered several times)
# The tag transformers looks for to decide whether a template can return an assistant mask.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PREPROCESS_HINT = "run `ds-megatron preprocess --sft --input FILE --output-prefix {prefix} --tokenizer DIR " \
                   "--seq-length S`"


def info_file_path(prefix: str) -> str:
    return prefix + ".sft.json"


def trained_prefix(prefix: str) -> str:
    """The prefix of the per-token flags dataset beside ``prefix``."""
    return prefix + ".trained"


def is_packed_sft(prefix: str) -> bool:
    """Whether ``prefix`` is (or was being written as) a packed SFT dataset rather than a pretraining one."""
    return os.path.isfile(info_file_path(prefix)) or os.path.isfile(trained_prefix(prefix) + ".idx")


@dataclass
class SFTStats:
    """What ``ds-megatron preprocess --sft`` prints as its last line (``as_dict``)."""

    rows: int = 0             # input rows read
    documents: int = 0        # conversations written
    tokens: int = 0           # their tokens (padding excluded)
    trained_tokens: int = 0   # their tokens flagged trained
    packed_rows: int = 0
    packing_efficiency: float = 0.0  # tokens / (packed_rows * seq_length)
    truncated: int = 0        # conversations cut to max_length (written, or left out as untrained)
    dropped: int = 0          # conversations longer than max_length left out (truncation "drop")
    untrained: int = 0        # conversations left out with nothing to train
    untrained_where: List[str] = field(default_factory=list, repr=False)  # the first few of them, by row

    def as_dict(self) -> Dict[str, Union[int, float]]:
        return {k: v for k, v in asdict(self).items() if k != "untrained_where"}


# -- one row -> (token ids, flags) -------------------------------------------------------------------------------

def _present(record: dict) -> dict:
    # datasets fills a field a row lacks with None (arrow columns are shared by all rows).
    return {k: v for k, v in record.items() if v is not None}


def _turns(where: str, value, field: str) -> List[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of {{\"role\", \"content\"}} turns, got "
                         f"{type(value).__name__}; fix the row")
    turns = []
    for k, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}: {field}[{k}] is a {type(turn).__name__}, not a {{\"role\", \"content\"}} "
                             "object; fix the row")
        turn = _present(turn)
        role = turn.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: {field}[{k}] has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str) and not (role == "assistant" and turn.get("tool_calls")):
            raise ValueError(f"{where}: {field}[{k}] ({role}) has no string 'content'; give each turn its text "
                             "(an assistant turn may instead carry 'tool_calls')")
        turns.append(turn)
    return turns


def _row_format(where: str, row: dict) -> str:
    if "messages" in row:
        return "messages"
    if "prompt" in row or "completion" in row:
        if "prompt" not in row or "completion" not in row:
            has, lacks = ("prompt", "completion") if "prompt" in row else ("completion", "prompt")
            raise ValueError(f"{where} has {has!r} but no {lacks!r}; give both, or write the row as 'messages'")
        return "prompt_completion"
    if "text" in row:
        return "text"
    found = ", ".join(map(str, row)) or "nothing"
    raise ValueError(f"{where} has no 'messages', 'prompt' / 'completion' or 'text' (found: {found}); write each "
                     "row in one of these formats")


class SFTEncoder:
    """Rows -> ``(ids, flags)`` with one tokenizer, the same in the main process and in every worker.

    A call takes ``(where, row)``: ``where`` names the row in errors (file and line, or row number), ``row`` is a
    dict or a JSON line.  It returns ``(result, None)`` or ``(None, error message)``, the error raised by the
    caller in input order; ``result`` is ``(where, status, ids, flags, truncated)`` with status ``"kept"``,
    ``"dropped"`` or ``"untrained"``.
    """

    def __init__(self, tokenizer: str, max_length: int, truncation: str):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"--truncation {truncation!r} is unknown; use one of {', '.join(TRUNCATIONS)}")
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self._tok = None

    def __getstate__(self):
        # Workers load their own tokenizer rather than receive this one pickled.
        return {**self.__dict__, "_tok": None}

    @property
    def tok(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer)
        return self._tok

    def __call__(self, unit: Tuple[str, Union[str, dict]]):
        where, row = unit
        try:
            if isinstance(row, str):
                try:
                    row = json.loads(row)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} is not valid JSON ({e.msg}); fix the line or pass a .jsonl file "
                                     "with one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object; write one object "
                                 "per row")
            ids, flags = self.encode(where, _present(row))
        except ValueError as e:
            return None, str(e)
        truncated = len(ids) > self.max_length
        if truncated and self.truncation == "drop":
            return (where, "dropped", None, None, True), None
        ids, flags = ids[:self.max_length], flags[:self.max_length]
        # The first token is never a label (nothing precedes it), so it alone is nothing to train.
        status = "kept" if (flags[1:] == TRAINED).any() else "untrained"
        return (where, status, ids, flags, truncated), None

    def encode(self, where: str, row: dict) -> Tuple[np.ndarray, np.ndarray]:
        """The token ids of one row and their ``TRAINED`` / ``UNTRAINED`` flags (rules in the module docstring)."""
        kind = _row_format(where, row)
        if kind == "messages":
            return self._conversation(where, _turns(where, row["messages"], "messages"), row.get("tools"))
        if kind == "text":
            ids = self._text_ids(where, row["text"], "text", special=True) + [self._eos(where)]
            return _arrays(ids, [TRAINED] * len(ids))
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            p = self._text_ids(where, prompt, "prompt", special=True)
            c = self._text_ids(where, completion, "completion", special=False) + [self._eos(where)]
            return _arrays(p + c, [UNTRAINED] * len(p) + [TRAINED] * len(c))
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt_turns = _turns(where, prompt, "prompt")
            completion_turns = _turns(where, completion, "completion")
            ids, flags = self._conversation(where, prompt_turns + completion_turns, row.get("tools"))
            head = self._render(where, prompt_turns, row.get("tools"),
                                add_generation_prompt=completion_turns[0]["role"] == "assistant")
            if list(ids[:len(head)]) != head:
                raise ValueError(f"{where}: the chat template renders the prompt differently once the completion "
                                 "follows, so the completion's tokens cannot be told apart; write the row as "
                                 "'messages'")
            flags[:len(head)] = UNTRAINED
            return ids, flags
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of turns, got "
                         f"{type(prompt).__name__} and {type(completion).__name__}")

    def _conversation(self, where: str, turns: List[dict], tools) -> Tuple[np.ndarray, np.ndarray]:
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"{where}: 'tools' must be a list of tool definitions, got {type(tools).__name__}")
        if self.tok.chat_template is None:
            raise ValueError(f"{where} holds turns but tokenizer {self.tokenizer!r} has no chat template; add "
                             "\"chat_template\" to its tokenizer_config.json or write prompt / completion rows")
        template = self.tok.get_chat_template(None, tools)
        if _GENERATION_TAG.search(template):
            out = self._apply(where, turns, tools, return_dict=True, return_assistant_tokens_mask=True)
            return _arrays(out["input_ids"], out["assistant_masks"])
        ids = self._render(where, turns, tools)
        flags = [UNTRAINED] * len(ids)
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            if k == 0:
                raise ValueError(f"{where}: the first turn is an assistant turn, and a chat template without "
                                 "{% generation %} markers tells its tokens apart only by rendering the turns "
                                 "before it; start with a system or user turn, or add the markers to the template")
            before = self._render(where, turns[:k], tools, add_generation_prompt=True)
            upto = self._render(where, turns[:k + 1], tools)
            if upto[:len(before)] != before or ids[:len(upto)] != upto:
                raise ValueError(f"{where}: the chat template renders the turns up to turn {k} (assistant) "
                                 "differently from the start of the whole conversation, so its tokens cannot be "
                                 "found without markers; put {% generation %} ... {% endgeneration %} around the "
                                 "assistant answer in the template")
            flags[len(before):len(upto)] = [TRAINED] * (len(upto) - len(before))
        return _arrays(ids, flags)

    def _render(self, where: str, turns: List[dict], tools, add_generation_prompt: bool = False) -> List[int]:
        return list(self._apply(where, turns, tools, return_dict=True,
                                add_generation_prompt=add_generation_prompt)["input_ids"])

    def _apply(self, where: str, turns: List[dict], tools, **kwargs):
        try:
            return self.tok.apply_chat_template(turns, tools=tools, tokenize=True, **kwargs)
        except Exception as e:  # the template's own errors (raise_exception, jinja) name nothing of the row
            raise ValueError(f"{where}: the chat template of {self.tokenizer!r} cannot render this row "
                             f"({type(e).__name__}: {e}); fix the row or the template") from None

    def _text_ids(self, where: str, text, field: str, special: bool) -> List[int]:
        if not isinstance(text, str):
            raise ValueError(f"{where}: {field!r} holds a {type(text).__name__}, not a string; fix the row")
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def _eos(self, where: str) -> int:
        if self.tok.eos_token_id is None:
            raise ValueError(f"{where}: prompt / completion and text rows end with the tokenizer's EOS, but "
                             f"{self.tokenizer!r} has none; set \"eos_token\" in its tokenizer_config.json")
        return int(self.tok.eos_token_id)


def _arrays(ids: Sequence[int], flags: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)


def load_tokenizer(directory: str):
    """``transformers.AutoTokenizer`` of a local directory; a ValueError naming ``--tokenizer`` if it fails."""
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer {directory!r} is not a directory; --sft needs a transformers tokenizer "
                         "directory (tokenizer.json and tokenizer_config.json, with a chat template for "
                         "'messages' rows)")
    # Imported here: only --sft renders chat templates, and transformers loads torch, which the rest of
    # preprocessing (a torch-free module) never needs.
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--sft renders chat templates with transformers, which is not installed; "
                         "pip install 'ds-megatron[sft]' (transformers and datasets)") from None
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {directory!r} does not load with transformers' AutoTokenizer ({e}); "
                         "give a directory saved by a tokenizer's save_pretrained") from None


def pad_id(tok) -> int:
    """The id of padding positions: the tokenizer's pad token, else its EOS, else 0 (never trained anyway)."""
    for candidate in (tok.pad_token_id, tok.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


# -- packing ------------------------------------------------------------------------------------------------------

class _OpenRows:
    """Open rows counted by free room, for "the least room >= n" in O(log capacity) (a segment tree of counts)."""

    def __init__(self, capacity: int):
        self.size = 1 << capacity.bit_length()  # leaves 0 .. size-1 cover every room 0 .. capacity
        self.count = [0] * (2 * self.size)

    def add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.count[i] += delta
            i >>= 1

    def least_at_least(self, n: int) -> Optional[int]:
        i = n + self.size
        while self.count[i] == 0:
            while i & 1:  # a right child: everything right of it lies right of its parent
                if i == 1:
                    return None
                i >>= 1
            i += 1
        while i < self.size:
            i = 2 * i if self.count[2 * i] else 2 * i + 1
        return i - self.size


def best_fit_decreasing(lengths: Sequence[int], capacity: int, seed: int) -> List[List[int]]:
    """The indices of ``lengths`` placed in each packed row, rows in the order they were opened."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"lengths must lie in 1..{capacity} to pack into rows of {capacity}, got "
                         f"{int(lengths.min())}..{int(lengths.max())}")
    tie_order = np.random.RandomState(seed).permutation(len(lengths))
    order = tie_order[np.argsort(-lengths[tie_order], kind="stable")]
    rows: List[List[int]] = []
    open_rows = _OpenRows(capacity)
    by_room: Dict[int, List[int]] = {}  # room -> heap of row numbers with that room
    for item in order.tolist():
        n = int(lengths[item])
        room = open_rows.least_at_least(n)
        if room is None:
            row, room = len(rows), capacity
            rows.append([])
        else:
            row = heapq.heappop(by_room[room])
            open_rows.add(room, -1)
        rows[row].append(item)
        if room - n > 0:
            heapq.heappush(by_room.setdefault(room - n, []), row)
            open_rows.add(room - n, 1)
    return rows


# -- writing and reading ------------------------------------------------------------------------------------------

def _remove_dataset(prefix: str) -> None:
    for ext in (".bin", ".idx", ".stats.json"):
        if os.path.exists(prefix + ext):
            os.remove(prefix + ext)


def build_packed_sft(units: Iterable[Tuple[str, Union[str, dict]]], output_prefix: str, tokenizer: str,
                     seq_length: int, max_length: Optional[int] = None, truncation: str = "right",
                     workers: int = 1, seed: int = 1234, sources: Sequence[str] = ()) -> SFTStats:
    """Encode ``units`` (``(where, row)`` in input order) in ``workers`` processes, pack and write them under
    ``output_prefix``; ``sources`` (the inputs) are recorded.  An input error raises before anything under
    ``output_prefix`` changes.
    """
    if workers < 1:
        raise ValueError(f"--workers {workers}: give 1 or more processes")
    if not isinstance(seq_length, int) or seq_length < 2:
        raise ValueError(f"--seq-length {seq_length!r}: give the training job's seq_length, 2 or more")
    max_length = seq_length if max_length is None else max_length
    if not isinstance(max_length, int) or not 1 <= max_length <= seq_length:
        raise ValueError(f"--max-length {max_length!r} must lie in 1..--seq-length {seq_length} (a conversation "
                         "is never split over packed rows)")
    encoder = SFTEncoder(tokenizer, max_length, truncation)
    tok = encoder.tok  # a bad --tokenizer fails before any worker starts or file is opened
    dtype = best_dtype(len(tok))
    stats, lengths = SFTStats(), []
    # Encoded conversations wait in a temporary dataset, so packing needs only their lengths in memory.
    staging = f"{output_prefix}.sft-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with contextlib.ExitStack() as stack:
            ids_out = stack.enter_context(IndexedDatasetBuilder(staging, dtype))
            flags_out = stack.enter_context(IndexedDatasetBuilder(trained_prefix(staging), np.uint8))
            # In input order: what is packed, and so the output, is one worker's.
            for where, status, ids, flags, truncated in encoded_in_order(encoder, units, workers, _CHUNK, stack):
                stats.rows += 1
                stats.truncated += truncated
                if status == "dropped":
                    stats.dropped += 1
                elif status == "untrained":
                    stats.untrained += 1
                    if len(stats.untrained_where) < 3:
                        stats.untrained_where.append(where)
                else:
                    ids_out.add_document(ids)
                    flags_out.add_document(flags)
                    lengths.append(len(ids))
                    stats.trained_tokens += int((flags == TRAINED).sum())
        if not lengths:
            raise ValueError(f"no conversation is left to train out of {stats.rows} rows ({stats.dropped} longer "
                             f"than --max-length {max_length} dropped, {stats.untrained} with nothing to train); "
                             "check the inputs, raise --max-length / --seq-length or use --truncation right")
        packed = best_fit_decreasing(lengths, seq_length, seed)
        stats.documents, stats.tokens, stats.packed_rows = len(lengths), int(sum(lengths)), len(packed)
        stats.packing_efficiency = stats.tokens / (stats.packed_rows * seq_length)
        _write_packed(staging, output_prefix, packed, seq_length, dtype, pad_id(tok))
    finally:
        _remove_dataset(staging)
        _remove_dataset(trained_prefix(staging))
    info = {"format": FORMAT, "version": FORMAT_VERSION, "seq_length": seq_length, "pad_id": pad_id(tok),
            "tokenizer": tokenizer, "vocab_size": len(tok), "max_length": max_length, "truncation": truncation,
            "seed": seed, "inputs": list(sources), "stats": stats.as_dict()}
    tmp = f"{info_file_path(output_prefix)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, info_file_path(output_prefix))
    return stats


def _write_packed(staging: str, output_prefix: str, packed: List[List[int]], seq_length: int, dtype,
                  pad: int) -> None:
    ids_in, flags_in = IndexedDataset(staging), IndexedDataset(trained_prefix(staging))
    # Until the new P.sft.json lands, P is "being written" (its flags exist, its marker does not), never an older
    # dataset's marker over newer files.
    if os.path.exists(info_file_path(output_prefix)):
        os.remove(info_file_path(output_prefix))
    # The flags finalize first: P.bin/.idx never stand new without them, to be read as a pretraining dataset.
    with IndexedDatasetBuilder(output_prefix, dtype) as ids_out:
        with IndexedDatasetBuilder(trained_prefix(output_prefix), np.uint8) as flags_out:
            for row in packed:
                used = 0
                for c in row:
                    ids_out.add_document(ids_in[c])
                    flags_out.add_document(flags_in[c])
                    used += int(ids_in.sizes[c])
                if used < seq_length:
                    ids_out.add_document(np.full(seq_length - used, pad, dtype=np.int64))
                    flags_out.add_document(np.full(seq_length - used, PADDING, dtype=np.uint8))


class PackedSFT:
    """A packed SFT dataset opened for reading: its info, tokens, flags and where each packed row's sequences are.

    ``row(r)`` gives the ``seq_length`` tokens of packed row ``r``, their flags, and the lengths of its segments
    (its conversations, then its padding tail if any).
    """

    def __init__(self, prefix: str, seq_length: int, tokens: Optional[IndexedDataset] = None):
        self.prefix = prefix
        hint = _PREPROCESS_HINT.format(prefix=prefix)
        path = info_file_path(prefix)
        try:
            with open(path) as f:
                info = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"packed SFT dataset {prefix!r} has no {path!r} (written last: the preprocessing "
                             f"did not finish); {hint}") from None
        except ValueError as e:
            raise ValueError(f"packed SFT dataset info {path!r} is not valid JSON ({e}); {hint}") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path!r} is not a {FORMAT!r} version {FORMAT_VERSION} file; {hint}")
        self.info = info
        self.seq_length, self.pad_id = int(info["seq_length"]), int(info["pad_id"])
        if seq_length != self.seq_length:
            raise ValueError(f"seq_length {seq_length} differs from the seq_length {self.seq_length} that data_path "
                             f"{prefix!r} was packed for; set seq_length to {self.seq_length} or re-pack with "
                             f"--seq-length {seq_length}")
        self.tokens = tokens if tokens is not None else IndexedDataset(prefix)
        self.flags = IndexedDataset(trained_prefix(prefix))
        sizes = np.asarray(self.tokens.sizes, dtype=np.int64)
        total = int(sizes.sum())
        self.num_rows = total // self.seq_length
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        bounds = np.arange(self.num_rows + 1, dtype=np.int64) * self.seq_length
        self.row_sequences = np.searchsorted(starts, bounds)
        if (not np.array_equal(sizes, np.asarray(self.flags.sizes, dtype=np.int64))
                or total != self.num_rows * self.seq_length or self.num_rows != info.get("stats", {}).get("packed_rows")
                or not np.array_equal(starts[self.row_sequences], bounds)):
            raise ValueError(f"packed SFT dataset {prefix!r} is inconsistent (its tokens, flags and "
                             f"{path!r} do not belong together); {hint}")

    def row(self, r: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        first, last = int(self.row_sequences[r]), int(self.row_sequences[r + 1])
        tokens = np.concatenate([self.tokens[s] for s in range(first, last)]).astype(np.int64)
        flags = np.concatenate([self.flags[s] for s in range(first, last)])
        return tokens, flags, np.asarray(self.tokens.sizes[first:last], dtype=np.int64)
