"""``ds_megatron.from_pretrained``: this rank's model built from a checkpoint directory and loaded with its weights.

The call a DeepSpeed user makes before ``ds_megatron.initialize`` (what ``ds-megatron train`` does for
``train.load_hf`` in ``training/build.py``): the model section comes from the checkpoint (a Hugging Face
``config.json`` through ``config.hf_config.model_from_hf``, or the ``ds_megatron_checkpoint.json`` of a directory
``ds-megatron convert`` wrote), only training settings may be changed, and each rank reads only its own shards
(``convert.model_io.load_weights``).  Without PP the model is a ``GPTModel``; with PP this rank's
``GPTModelChunks`` (our pipeline runtime).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..config.hf_config import METADATA, model_of_checkpoint
from ..config.job import RUNTIME_MODEL_KEYS
from ..config.model import GPTConfig
from ..config import ConfigError
from ..convert.model_io import load_weights, stage_layers
from ..integration.runtime import accelerator_device_type
from ..models.gpt import GPTModel
from ..models.gpt_chunks import GPTModelChunks
from ..parallel_state import ParallelState
from ..tensor_parallel import RNGStatesTracker, model_parallel_seed

# Model fields a caller may set: training settings, not the architecture (those a load_hf job may set, and
# sequence_parallel, which a job takes from its megatron section)
OVERRIDABLE = RUNTIME_MODEL_KEYS + ("sequence_parallel",)
# The pipeline split of GPTModelChunks, under Megatron's names (the megatron section's keys)
PIPELINE_OPTIONS = {"virtual_pipeline_model_parallel_size": "num_model_chunks",
                    "pipeline_num_layers_per_stage": "layers_per_stage",
                    "decoder_first_pipeline_num_layers": "first_stage_layers",
                    "decoder_last_pipeline_num_layers": "last_stage_layers"}
OTHER_OPTIONS = ("seed", "dtype")
_FIELDS = set(GPTConfig.__dataclass_fields__)


def pretrained_config(path: str, notices: Optional[List[str]] = None, **overrides) -> GPTConfig:
    """The checkpoint's model with ``overrides`` of training settings; an override that would change the
    architecture (a field outside ``OVERRIDABLE`` set to another value) is refused naming it.  ``mtp_num_layers``
    chooses the multi-token-prediction layers (``config.hf_config.resolve_mtp``; its line goes to ``notices``)."""
    mtp = overrides.pop("mtp_num_layers", None)
    try:
        model = model_of_checkpoint(path, mtp, notices)
    except ConfigError as e:  # ConvertError "config.json: ...": name the directory too
        raise type(e)(f"{path}/{e}" if str(e).startswith("config.json") else str(e)) from None
    if model is None:
        raise ConfigError(f"{path}: neither a Hugging Face checkpoint (config.json) nor ours ({METADATA})")
    for alias in ("layernorm_epsilon", "moe_shared_expert_ffn_hidden_size"):  # ours stores them resolved
        model.pop(alias, None)
    base = GPTConfig(**model)
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise ConfigError(f"from_pretrained: unknown option {key!r}; use the model's training settings "
                              f"({', '.join(OVERRIDABLE)}), mtp_num_layers, {', '.join(OTHER_OPTIONS)} or the "
                              f"pipeline's {', '.join(PIPELINE_OPTIONS)}")
        if key not in OVERRIDABLE and value != getattr(base, key):
            raise ConfigError(f"from_pretrained: model.{key}={value!r} would change the architecture {path} "
                              f"fixes ({getattr(base, key)!r}); drop it (only training settings "
                              f"such as sequence_parallel, dropout, seq_length, recompute_granularity may change)")
    if overrides.get("seq_length", 0) > base.seq_length:
        # beyond a sliding window full attention is no longer the checkpoint's attention
        raise ConfigError(f"from_pretrained: seq_length={overrides['seq_length']} exceeds the {base.seq_length} "
                          f"positions the model at {path} supports; lower it")
    return GPTConfig(**{**model, **overrides})


def from_pretrained(path: str, parallel_state: Optional[ParallelState] = None, **options: Any) -> torch.nn.Module:
    """This rank's model of the checkpoint at ``path`` with its weights (see the module docstring).

    ``parallel_state``: the job's (``ds_megatron.initialize_model_parallel(config)``); None: one rank.
    ``options``: model training settings (``OVERRIDABLE``); ``mtp_num_layers`` (unset: the multi-token-prediction
    layers the files hold, off with a printed line when config.json declares layers the files lack; 0: off);
    ``seed`` (default 1234, as ``ds-megatron train``)
    seeds the dropout streams Megatron's way; ``dtype`` (default float32) of the parameters; with PP the split
    (``PIPELINE_OPTIONS``: ``virtual_pipeline_model_parallel_size`` chunks per rank, uneven stages).
    """
    state = parallel_state if parallel_state is not None else ParallelState.single()
    seed = options.pop("seed", 1234)
    dtype = options.pop("dtype", torch.float32)
    pipeline: Dict[str, Any] = {PIPELINE_OPTIONS[k]: options.pop(k) for k in list(options) if k in PIPELINE_OPTIONS}
    notices: List[str] = []
    config = pretrained_config(path, notices, **options)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for notice in notices:
            print(notice)
    if pipeline and state.pp.size == 1 and any(v not in (None, 1) for v in pipeline.values()):
        name = next(k for k, v in PIPELINE_OPTIONS.items() if pipeline.get(v) not in (None, 1))
        raise ConfigError(f"from_pretrained: {name} is given but the layout has pipeline_model_parallel_size 1; "
                          "drop it or build the ParallelState with a pipeline")
    tracker = RNGStatesTracker(accelerator_device_type())
    torch.manual_seed(seed)  # as ds-megatron train builds: every weight is overwritten below
    if state.pp.size > 1:
        model = GPTModelChunks(config, state, rng_tracker=tracker,
                               **{k: v for k, v in pipeline.items() if v is not None})
    else:
        model = GPTModel(config, state, rng_tracker=tracker)
    model.to(dtype)  # before loading: the checkpoint's values are cast once, to the parameters' dtype
    load_weights(model, path, state, stage_layers(model))
    model_parallel_seed(seed, state.tp.rank, state.pp.rank, state.ep.rank, state.etp.rank, tracker=tracker)
    return model
