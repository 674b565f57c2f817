"""Encoding inputs in worker processes, in input order (``ds-megatron preprocess``, with and without ``--sft``).

An encoder returns ``(result, None)`` or ``(None, error message)`` rather than raising, so that a worker's error
reaches the main process as text and is raised there at its input's place: what was read before it is handled, and
the output of any number of workers is byte for byte one worker's (``imap`` keeps the order).
"""
from __future__ import annotations

import contextlib
import multiprocessing
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple


def encoded_in_order(encoder: Callable[[Any], Tuple[Any, Optional[str]]], units: Iterable[Any], workers: int,
                     chunksize: int, stack: contextlib.ExitStack) -> Iterator[Any]:
    """``encoder(unit)``'s results in the order of ``units``, from ``workers`` spawned processes (1: this one);
    an error message an encoder returns is raised as a ``ValueError`` there.  The pool lives as long as ``stack``."""
    if workers > 1:
        pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers))
        encoded = pool.imap(encoder, units, chunksize=chunksize)
    else:
        encoded = map(encoder, units)
    for result, error in encoded:
        if error is not None:
            raise ValueError(error)
        yield result
