"""Reading JSON into the config dataclasses: types, unknown keys, file loading (pure Python).

``parse_section(cls, data, where)`` builds a dataclass from a JSON object and
names the offending field (``megatron.cuda_graph.scope[0]``) in one sentence
when a key is unknown or a value has the wrong type; the dataclass's own
``__post_init__`` checks the values.  ``unknown_key`` is the one message for a
key a section does not have, wherever it is found: the likely key it meant.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import ConfigError

SECTION = "megatron"
# Where every key of every section is listed, for an unknown key close to none of them.
KEYS_DOC = "docs/configuration.md"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def coerce(where: str, value, tp):
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) > 1:  # e.g. Union[int, List[int]]: the first type the value fits
            for arg in args:
                try:
                    return coerce(where, value, arg)
                except ConfigError:
                    pass
            names = [str(a).replace("typing.", "") if typing.get_origin(a) else _type_name(a) for a in args]
            raise ConfigError(f"{where} must be one of {', '.join(names)}, got {value!r}")
        return coerce(where, value, args[0])
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, where)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object, got {type(value).__name__}")
        return dict(value)
    if origin in (list, List, tuple, Tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a JSON list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [coerce(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{where} must be of type {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def unknown_key(where: str, key: str, known: Sequence[str]) -> ConfigError:
    """The error for ``where.key``, which section ``where`` does not have: the known key it most likely meant (a
    typo, another case), or where the keys are listed; never the whole list."""
    typed = key.lower()
    nearest = difflib.get_close_matches(typed, known, n=3, cutoff=0.6)
    if not nearest:
        return ConfigError(f"unknown key {where}.{key}; {KEYS_DOC} lists every key of {where}")
    score = {k: difflib.SequenceMatcher(None, typed, k).ratio() for k in nearest}
    likely = [f"{where}.{k}" for k in known if score.get(k) == score[nearest[0]]]  # ties: adam_beta -> 1 or 2
    return ConfigError(f"unknown key {where}.{key}; did you mean {' or '.join(likely)}?")


def field_names(cls) -> List[str]:
    return [f.name for f in dataclasses.fields(cls)]


def parse_section(cls, data: Dict[str, Any], where: str):
    """Build dataclass ``cls`` from ``data``: unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = field_names(cls)
    for key in data:
        if key not in known:
            raise unknown_key(where, key, known)
    kwargs = {k: coerce(f"{where}.{k}", v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def load_ds_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """The DeepSpeed config as a dict, from a path or a dict (copied, never mutated)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist; pass the path of a DeepSpeed JSON config")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None


def deepspeed_section(ds_config: Dict[str, Any], key: str) -> Dict[str, Any]:
    """A DeepSpeed config section that must be a JSON object (empty when absent)."""
    value = ds_config.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {value!r}")
    return value


def world_size_from_env() -> Optional[int]:
    """The job's world size as the launcher announced it, before torch.distributed starts."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def local_rank_from_env() -> int:
    """This process's rank on its node as the launcher announced it (the job's rank when it names none: one node;
    0 when no launcher started it)."""
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "RANK", "OMPI_COMM_WORLD_RANK",
                "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
