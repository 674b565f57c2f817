"""A training job's config (``ds-megatron train``, ``ds-megatron plan``): every section parsed and checked, torch-free.

``load_job`` parses every section of the DeepSpeed JSON and checks it against
the world size the launcher announced, creating nothing; the job's own rules
live here (one source for the learning rate, DeepSpeed's activation
checkpointing mapped onto recomputation, the model read from ``load_hf``'s
checkpoint, the Hugging Face family a from-scratch job exports as).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from ..errors import ConfigError
from .hf_config import METADATA, hf_config_from_model, model_of_checkpoint
from .megatron import MegatronConfig, split_config
from .model import GPTConfig
from .parsing import SECTION, load_ds_config
from .training import DataConfig, TrainConfig


@dataclass
class JobConfig:
    """A validated job: the config DeepSpeed gets and our parsed section (with its model, train and data)."""

    ds_config: Dict[str, Any]
    megatron: MegatronConfig
    world_size: Optional[int] = None  # the ranks load_job checked the layout for

    @property
    def model(self) -> GPTConfig:
        return self.megatron.model

    @property
    def train(self) -> TrainConfig:
        return self.megatron.train

    @property
    def data(self) -> DataConfig:
        return self.megatron.data


# megatron.train fields that DeepSpeed's optimizer / scheduler sections replace.
OPTIMIZER_FIELDS = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
SCHEDULE_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style")
# DeepSpeed activation_checkpointing keys our recomputation (torch's checkpoint per layer) has no equivalent for.
_AC_UNSUPPORTED = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "synchronize_checkpoint_boundary", "profile")


def check_one_lr_source(ds_config: Dict[str, Any], mcfg: MegatronConfig) -> None:
    """The job's one rule for the optimizer and learning rate (docs/configuration.md, "Batch, optimizer, schedule").

    Without DeepSpeed ``optimizer`` / ``scheduler`` sections, ``megatron.train`` builds AdamW (lr, weight_decay,
    adam_*) and the warmup + decay schedule (lr, min_lr, lr_warmup_iters, lr_decay_style).  A DeepSpeed section
    takes over what it names (DeepSpeed's own precedence), and the ``megatron.train`` fields it replaces must then
    be left out: given both, the job stops here naming both instead of silently using one.
    """
    given = set(mcfg.train_keys_set)
    for section, fields in (("optimizer", OPTIMIZER_FIELDS), ("scheduler", SCHEDULE_FIELDS)):
        both = [f for f in fields if f in given]
        if section in ds_config and both:
            raise ConfigError(f"{SECTION}.train.{both[0]} and DeepSpeed's \"{section}\" section are both given, and the "
                              f"section would silently win; set the learning rate in one place: remove "
                              f"{', '.join(f'{SECTION}.train.{f}' for f in both)} or the \"{section}\" section")
    if "optimizer" in ds_config and "scheduler" not in ds_config:
        schedule = [f for f in SCHEDULE_FIELDS if f in given]
        if schedule:
            raise ConfigError(f"{SECTION}.train.{schedule[0]} is set, but with DeepSpeed's \"optimizer\" section and no "
                              "\"scheduler\" section the learning rate stays at optimizer.params.lr; add a \"scheduler\" "
                              "section, or drop the \"optimizer\" section to use megatron.train's optimizer and schedule")


def map_activation_checkpointing(ds_config: Dict[str, Any], mcfg: MegatronConfig) -> None:
    """DeepSpeed's ``activation_checkpointing`` section onto the job's recomputation, or a ConfigError.

    The job's GPT recomputes each layer in backward (``megatron.model.recompute_granularity: "full"``,
    torch's checkpoint with the model's RNG tracker); the section turns that on.  Its options that
    have no equivalent there are refused naming the key.
    """
    section = ds_config.get("activation_checkpointing")
    if section is None:
        return
    if not isinstance(section, dict):
        raise ConfigError(f"activation_checkpointing must be a JSON object, got {section!r}")
    for key in _AC_UNSUPPORTED:
        if section.get(key):
            raise ConfigError(f"activation_checkpointing.{key} is true, but ds-megatron train recomputes with "
                              f"{SECTION}.model.recompute_granularity \"full\" (every layer, activations kept on the "
                              f"device, not partitioned), which has no such option; remove the key")
    if section.get("number_checkpoints") is not None:
        raise ConfigError(f"activation_checkpointing.number_checkpoints={section['number_checkpoints']!r}: "
                          f"ds-megatron train recomputes every layer ({SECTION}.model.recompute_granularity "
                          "\"full\"); remove the key")
    if mcfg.model.recompute_granularity is None:
        mcfg.model.recompute_granularity = "full"
        mcfg.notices.append(f"activation_checkpointing: ds-megatron train recomputes every layer in backward "
                            f"({SECTION}.model.recompute_granularity \"full\")")


# Model keys a job may still set when the architecture comes from a checkpoint (load_hf).
RUNTIME_MODEL_KEYS = ("seq_length", "hidden_dropout", "attention_dropout", "recompute_granularity", "recompute_modules",
                      "recompute_method", "recompute_num_layers", "mlp_sequence_tiles",
                      "loss_sequence_tiles", "label_smoothing",
                      "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type", "moe_grouped_gemm",
                      "moe_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
                      "moe_router_dtype",  # the router's precision (DeepSeek-V3 maps fp32), not its weights
                      "cp_comm_type")  # how context-parallel attention exchanges K/V, not what it computes


def model_from_checkpoint(path: str, section: Dict[str, Any], mcfg: MegatronConfig) -> GPTConfig:
    """The model section of a job that starts from ``path``: the checkpoint's architecture plus the job's runtime keys."""
    for key in section:
        if key not in RUNTIME_MODEL_KEYS + ("mtp_num_layers",):
            raise ConfigError(f"{SECTION}.model.{key} is set but {SECTION}.train.load_hf={path!r} defines the "
                              f"architecture; keep only {', '.join(RUNTIME_MODEL_KEYS)} and mtp_num_layers in the "
                              "model section")
    # mtp_num_layers: the checkpoint's multi-token-prediction layers (unset), or none (0); see resolve_mtp
    section = dict(section)
    model = model_of_checkpoint(path, section.pop("mtp_num_layers", None), mcfg.notices)
    if model is None:
        raise ConfigError(f"{SECTION}.train.load_hf={path!r} has no config.json ({METADATA}); give a Hugging Face "
                          "checkpoint directory or one `ds-megatron convert` wrote")
    if "seq_length" in section and section["seq_length"] > model["seq_length"]:
        raise ConfigError(f"{SECTION}.model.seq_length={section['seq_length']} exceeds the {model['seq_length']} "
                          f"positions the model at {path} supports; lower it")
    model.update(section, sequence_parallel=mcfg.parallel.sequence_parallel,
                 make_vocab_size_divisible_by=mcfg.parallel.make_vocab_size_divisible_by)
    for alias in ("layernorm_epsilon", "moe_shared_expert_ffn_hidden_size"):
        model.pop(alias, None)
    return GPTConfig(**model)


def export_hf_config(mcfg: MegatronConfig) -> Dict[str, Any]:
    """The ``config.json`` a from-scratch job's model exports as (``train.export_hf_family``), or a ConfigError."""
    field = f"{SECTION}.train.export_hf_family"
    if mcfg.train.load_hf is not None:
        raise ConfigError(f"{field} and {SECTION}.train.load_hf are both set; a job started from a checkpoint exports "
                          "as that checkpoint's family: remove export_hf_family")
    eos = None if mcfg.data.tokenizer == "byte" else mcfg.data.build_tokenizer().eod
    return hf_config_from_model(mcfg.train.export_hf_family, asdict(mcfg.model), field, eos)


def parse_job_config(config, load_hf: Optional[str] = None) -> JobConfig:
    """Every section of a job config, validated; raises ConfigError naming the field."""
    ds_config, mcfg = split_config(config)
    if load_hf is not None:
        mcfg.train.load_hf = load_hf
    if mcfg.train.load_hf is not None:
        section = (load_ds_config(config).get(SECTION) or {}).get("model") or {}
        mcfg.model = model_from_checkpoint(mcfg.train.load_hf, section, mcfg)
        tokens = mcfg.data.build_tokenizer().vocab_size
        if mcfg.model.vocab_size < tokens:
            what = "byte" if mcfg.data.tokenizer == "byte" else repr(mcfg.data.tokenizer)
            raise ConfigError(f"the model at {mcfg.train.load_hf} has vocab_size={mcfg.model.vocab_size} but the "
                              f"{what} tokenizer ({SECTION}.data.tokenizer) emits ids up to {tokens - 1}; use a model "
                              "whose vocab covers the tokenizer")
    if mcfg.model is None:
        mcfg.model = GPTConfig(sequence_parallel=mcfg.parallel.sequence_parallel,
                               make_vocab_size_divisible_by=mcfg.parallel.make_vocab_size_divisible_by)
    if mcfg.train.export_hf_family is not None:
        export_hf_config(mcfg)  # refused now if the family cannot express the model
    check_one_lr_source(ds_config, mcfg)
    map_activation_checkpointing(ds_config, mcfg)
    if "train_micro_batch_size_per_gpu" not in ds_config:
        raise ConfigError("train_micro_batch_size_per_gpu is missing from the DeepSpeed config; set it (e.g. 4)")
    if "train_batch_size" in ds_config:
        raise ConfigError("train_batch_size is set; ds-megatron train derives it from "
                          "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size: remove it")
    return JobConfig(ds_config, mcfg)


def load_job(config, world_size: int, train_iters: Optional[int] = None,
             output_dir: Optional[str] = None, load_hf: Optional[str] = None) -> JobConfig:
    """Parse and validate every section for ``world_size`` ranks; creates nothing."""
    job = parse_job_config(config, load_hf)
    job.megatron.layout(world_size)  # the layout fits the world and the model fits the layout
    job.world_size = world_size
    job.data.check_vocab(job.model.vocab_size)  # every token id has a logit
    if train_iters is not None:
        if train_iters < 1:
            raise ConfigError(f"--train-iters must be >= 1, got {train_iters}")
        job.train.train_iters = train_iters
    if "optimizer" not in job.ds_config and "scheduler" not in job.ds_config:  # megatron.train's schedule runs
        notice = job.train.check_warmup(None if train_iters is None else f"--train-iters {train_iters}")
        if notice:
            job.megatron.notices.append(notice)
    if output_dir is not None:
        job.train.output_dir = output_dir
    return job
