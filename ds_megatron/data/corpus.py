"""The default training corpus: the running Python's own standard-library sources.

Every machine that runs ds_megatron has these files, so a demo or test job can
train on real text with no download and no data flag.  The selection is
deterministic: all ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
except test suites and installed packages, sorted by their path relative to
the stdlib root, taken whole in that order until the next file would exceed
``max_bytes``.  Each file is one document.  The same Python version therefore
yields byte-identical ``.bin``/``.idx`` files on every machine.

The dataset is built once per (Python version, byte budget, tokenizer) and
cached under a prefix that names that key; later calls just return it.
"""
from __future__ import annotations

import fcntl
import os
import platform
import sysconfig
from typing import List, Optional, Tuple

from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype, dataset_exists
from .tokenizer import build_tokenizer, tokenizer_key

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
# Test suites are large, repetitive and partly non-UTF-8 on purpose; packages
# in site-packages differ from machine to machine.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def default_cache_dir() -> str:
    """``$DS_MEGATRON_CACHE``, else ``~/.cache/ds_megatron``."""
    return os.environ.get("DS_MEGATRON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "ds_megatron")


def stdlib_source_files(max_bytes: int = DEFAULT_MAX_BYTES, stdlib_dir: Optional[str] = None
                        ) -> List[Tuple[str, int]]:
    """(relative path, size) of the files the corpus takes, in corpus order."""
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"Python standard library directory {root!r} does not exist; "
                                f"preprocess your own corpus with `ds-megatron preprocess` instead")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                found.append(rel)
    chosen, total = [], 0
    for rel in sorted(found):
        size = os.path.getsize(os.path.join(root, rel))
        if total + size > max_bytes:
            break
        chosen.append((rel, size))
        total += size
    return chosen


def default_dataset_prefix(output_prefix_dir: str, max_bytes: int = DEFAULT_MAX_BYTES,
                           tokenizer: str = "byte", eod_token: Optional[str] = None) -> str:
    """Cache prefix for one key: Python implementation and version, budget, tokenizer (a Hugging Face one by the
    hash of its file and its end-of-document id)."""
    version = f"{platform.python_implementation().lower()}{platform.python_version()}"
    return os.path.join(output_prefix_dir, f"stdlib-{version}-{max_bytes}-{tokenizer_key(tokenizer, eod_token)}")


def build_default_dataset(output_prefix_dir: Optional[str] = None, max_bytes: int = DEFAULT_MAX_BYTES,
                          tokenizer: str = "byte", eod_token: Optional[str] = None) -> str:
    """Build (or reuse) the stdlib corpus dataset; returns its prefix."""
    output_prefix_dir = output_prefix_dir or default_cache_dir()
    prefix = default_dataset_prefix(output_prefix_dir, max_bytes, tokenizer, eod_token)
    os.makedirs(output_prefix_dir, exist_ok=True)
    # Several ranks of one node may ask at once: one builds, the rest wait and reuse.
    with open(prefix + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _usable(prefix):
            return prefix
        tok = build_tokenizer(tokenizer, eod_token)
        root = sysconfig.get_paths()["stdlib"]
        files = stdlib_source_files(max_bytes, root)
        with IndexedDatasetBuilder(prefix, best_dtype(tok.vocab_size)) as builder:
            for rel, _ in files:
                with open(os.path.join(root, rel), "rb") as f:
                    # PEP 3120 makes these UTF-8; "replace" keeps an odd file from
                    # stopping the build and is itself deterministic.
                    text = f.read().decode("utf-8", errors="replace")
                ids = tok.tokenize(text)
                if ids:
                    builder.add_document(ids + [tok.eod])
    return prefix


def _usable(prefix: str) -> bool:
    if not dataset_exists(prefix):
        return False
    try:
        IndexedDataset(prefix)
    except ValueError:
        return False
    return True
