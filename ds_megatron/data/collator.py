"""Packing tokenized examples into micro-batches in a user's own loop (TRL's padding-free flattening, in rows).

``PackedCollator(seq_length, pad_id)`` is a ``collate_fn``: given a list of examples it packs them whole by
best-fit-decreasing (``sft.best_fit_decreasing``, as ``ds-megatron preprocess --sft``) into as few rows of
``seq_length`` tokens as hold them and returns the batch ``engine(batch)`` / ``GPTModel`` take:

* ``tokens``, ``labels`` (the next token), ``loss_mask`` (float), ``position_ids`` restarting at 0 at each example
  and ``padding_mask`` (the rows' unused tails), each ``[rows, seq_length]``.

An example is a dict with ``input_ids`` and optionally which tokens are trained, in the Hugging Face convention
(unshifted: token i is trained when it is the target): ``labels`` with -100 for untrained tokens (TRL,
``DataCollatorForLanguageModeling``), or ``assistant_masks`` (``apply_chat_template(...,
return_assistant_tokens_mask=True)``); neither: every token but the first.  A token trains only the position
before it in its own example: no label crosses into another example.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

import torch

from .sft import best_fit_decreasing

IGNORE_INDEX = -100  # Hugging Face's label of an untrained token


def _trained(example: Mapping, n: int) -> List[bool]:
    """Which of an example's ``n`` tokens are targets."""
    if "labels" in example and example["labels"] is not None:
        labels = list(example["labels"])
        if len(labels) != n:
            raise ValueError(f"an example has {n} input_ids but {len(labels)} labels; give one label per token "
                             "(the token itself, or -100 where it is not trained)")
        return [int(x) != IGNORE_INDEX for x in labels]
    if "assistant_masks" in example and example["assistant_masks"] is not None:
        mask = list(example["assistant_masks"])
        if len(mask) != n:
            raise ValueError(f"an example has {n} input_ids but {len(mask)} assistant_masks; give one per token")
        return [bool(x) for x in mask]
    return [True] * n


class PackedCollator:
    """``collate_fn`` packing examples into rows of ``seq_length`` (see the module docstring).

    ``seed``: the order among examples of equal length, for the packing.  An example longer than ``seq_length``
    is refused (truncate it first, or raise seq_length)."""

    def __init__(self, seq_length: int, pad_id: int = 0, seed: int = 1234):
        if seq_length < 2:
            raise ValueError(f"seq_length must be at least 2, got {seq_length}")
        self.seq_length, self.pad_id, self.seed = seq_length, pad_id, seed

    def __call__(self, examples: Sequence[Mapping]) -> Dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("PackedCollator got no examples; give a batch of at least one")
        ids = [[int(t) for t in example["input_ids"]] for example in examples]
        for k, x in enumerate(ids):
            if not 1 <= len(x) <= self.seq_length:
                raise ValueError(f"example {k} has {len(x)} tokens; each must have 1 to seq_length="
                                 f"{self.seq_length} (truncate it first or raise seq_length)")
        rows = best_fit_decreasing([len(x) for x in ids], self.seq_length, self.seed)
        s = self.seq_length
        batch = {"tokens": torch.full((len(rows), s), self.pad_id, dtype=torch.int64),
                 "labels": torch.full((len(rows), s), self.pad_id, dtype=torch.int64),
                 "loss_mask": torch.zeros(len(rows), s, dtype=torch.float32),
                 "position_ids": torch.zeros(len(rows), s, dtype=torch.int64),
                 "padding_mask": torch.ones(len(rows), s, dtype=torch.bool)}
        for r, row in enumerate(rows):
            start = 0
            for k in row:
                x, n = ids[k], len(ids[k])
                trained = _trained(examples[k], n)
                stop = start + n
                batch["tokens"][r, start:stop] = torch.tensor(x)
                batch["labels"][r, start:stop - 1] = torch.tensor(x[1:], dtype=torch.int64)
                batch["loss_mask"][r, start:stop - 1] = torch.tensor(trained[1:], dtype=torch.float32)
                batch["position_ids"][r, start:stop] = torch.arange(n)
                batch["padding_mask"][r, start:stop] = False
                start = stop
            batch["position_ids"][r, start:] = torch.arange(s - start)  # the tail: a segment of its own
        return batch


__all__ = ["IGNORE_INDEX", "PackedCollator"]
