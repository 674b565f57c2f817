"""The build phase of ``ds-megatron train``: groups, model, optimizer, engine, data, in that order.

Every weight is drawn from ``train.seed`` alone, so any TP / PP layout holds the same
full model; the dropout streams are seeded afterwards, Megatron's way.  A job that
starts from a Hugging Face checkpoint (``load_hf``) copies each rank's shards into the
model before the engine exists, so the optimizer's fp32 main params start from them.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..checkpointing.torch_dist import check_supported
from ..config.job import JobConfig
from ..config.megatron import INHERITED_MODEL_KEYS
from ..config.parsing import load_ds_config
from ..config.pipeline import pipeline_runtime, virtual_pipeline_size
from ..config.training import DataConfig
from ..convert.model_io import load_weights, stage_layers
from ..data.corpus import build_default_dataset
from ..data.blended_dataset import build_blended_dataset
from ..data.gpt_dataset import GPTDataset, parse_split, split_fractions
from ..data.indexed_dataset import IndexedDataset
from ..data.sampler import build_data_loader
from ..data.sft import is_packed_sft
from ..data.sft_dataset import PackedSFTDataset
from ..integration.engine import initialize, initialize_model_parallel
from ..integration.pipeline import GPTPipelineModule
from ..integration.runtime import accelerator_device_type
from ..models.gpt import GPTModel
from ..models.gpt_chunks import GPTModelChunks
from ..optimizer import get_param_groups
from ..parallel_state import ParallelState
from ..tensor_parallel import RNGStatesTracker, model_parallel_seed
from .lr_schedule import build_lr_scheduler


@dataclass
class Batches:
    """The step's shape: micro-batch size, micro-batches per step, the global batch (samples per step)."""

    micro_batch: int
    micro_batches: int
    global_batch: int


@dataclass
class TrainingSetup:
    """What the build phase made for the loop."""

    state: ParallelState
    model: torch.nn.Module  # GPTModel, or this rank's GPTPipelineModule stage or GPTModelChunks
    rng_tracker: RNGStatesTracker
    engine: Any
    batches: Batches
    pin_memory: bool  # batches in page-locked memory (a GPU job copies them asynchronously)

    @property
    def pipeline(self) -> bool:
        return self.state.pp.size > 1


def build_model(job: JobConfig, state: ParallelState):
    """The job's model and its RNG tracker: ``GPTModel``, or with PP this rank's ``GPTModelChunks`` (our
    runtime, every schedule), or on DeepSpeed's optimizer path with "1f1b" its ``GPTPipelineModule`` stage
    (DeepSpeed's engine; ``config.pipeline.pipeline_runtime``).

    The dropout streams are seeded after construction (``seed + 100 * pp_rank`` for the default
    generator, a TP-rank offset for the tracker), so that no two stages or TP ranks draw the same masks.
    """
    seed = job.train.seed
    tracker = RNGStatesTracker(accelerator_device_type())
    torch.manual_seed(seed)
    parallel = job.megatron.parallel
    uneven = dict(layers_per_stage=parallel.pipeline_num_layers_per_stage,
                  first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                  last_stage_layers=parallel.decoder_last_pipeline_num_layers)
    if state.pp.size > 1 and pipeline_runtime(parallel, job.megatron.optimizer_impl) == "ds_megatron":
        if parallel.pipeline_partition_method == "parameters" and not any(uneven.values()):
            # One chunk per stage (the config refuses "parameters" with v > 1): the split as counts.
            uneven["layers_per_stage"] = [len(r) for r in pipeline_stage_layers(job.model, state.layout,
                                                                                "parameters")]
        model = GPTModelChunks(job.model, state, rng_tracker=tracker,
                               num_model_chunks=virtual_pipeline_size(parallel, job.model.num_layers, state.pp.size),
                               **uneven)
    elif state.pp.size > 1:
        model = GPTPipelineModule(job.model, state, rng_tracker=tracker,
                                  partition_method=parallel.pipeline_partition_method, **uneven)
    else:
        model = GPTModel(job.model, state, rng_tracker=tracker)
    if job.train.load_hf:
        # Before ds_megatron.initialize: the optimizer's fp32 main params are copied from these weights.
        load_weights(model, job.train.load_hf, state, stage_layers(model))
    model_parallel_seed(seed, state.tp.rank, state.pp.rank, state.ep.rank, state.etp.rank, tracker=tracker)
    return model, tracker


def build_optimizer(job: JobConfig, model: torch.nn.Module):
    """``(optimizer, scheduler)`` from ``megatron.train``: AdamW and the warmup + decay schedule; None for what
    DeepSpeed's own ``optimizer`` / ``scheduler`` sections build instead."""
    tcfg, ds_config = job.train, job.ds_config
    if "optimizer" in ds_config:
        return None, None  # DeepSpeed builds both from its own sections
    optimizer = torch.optim.AdamW(get_param_groups(model), lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2),
                                  eps=tcfg.adam_eps, weight_decay=tcfg.weight_decay)
    scheduler = None if "scheduler" in ds_config else build_lr_scheduler(
        optimizer, tcfg.lr, tcfg.min_lr, tcfg.lr_warmup_iters, tcfg.lr_decay_iters or tcfg.train_iters,
        tcfg.lr_decay_style)
    return optimizer, scheduler


def engine_config(job: JobConfig, config_source):
    """The config ``ds_megatron.initialize`` validates again.  With ``train.load_hf`` the file's model section holds
    only runtime keys, which on their own read as a default dense model (and EP > 1 would be refused against it):
    the engine gets the job's resolved model instead, the checkpoint's architecture with those keys applied."""
    if job.train.load_hf is None:
        return config_source
    config = load_ds_config(config_source)
    model = asdict(job.model)
    # aliases resolved into their fields; keys the section's top level sets (sequence_parallel, ...) stay there
    for key in ("layernorm_epsilon", "moe_shared_expert_ffn_hidden_size", *INHERITED_MODEL_KEYS):
        model.pop(key, None)
    section = config.setdefault("megatron", {})
    section["model"] = model
    section.setdefault("train", {}).pop("load_hf", None)  # already resolved into the model section
    return config


def build(job: JobConfig, config_source) -> TrainingSetup:
    """Groups, model, optimizer and engine; refuses now a ``torch_dist`` job whose state that format cannot hold."""
    state = initialize_model_parallel(job.megatron)
    model, tracker = build_model(job, state)
    optimizer, scheduler = build_optimizer(job, model)
    engine, _, _, _ = initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                 config=engine_config(job, config_source),
                                 model_parameters=get_param_groups(model) if optimizer is None else None,
                                 parallel_state=state)
    if job.train.ckpt_format == "torch_dist":
        check_supported(engine)  # before any step: a job that cannot save this way must not train first
    mbs = job.ds_config["train_micro_batch_size_per_gpu"]
    gas = job.ds_config.get("gradient_accumulation_steps", 1)
    return TrainingSetup(state=state, model=model, rng_tracker=tracker, engine=engine,
                         batches=Batches(mbs, gas, mbs * gas * state.dp.size),
                         pin_memory=torch.device(engine.device).type == "cuda")


@dataclass
class TrainingData:
    """The training batches (an iterator from the consumed position on) and the validation set."""

    train: Iterator[Dict[str, Any]]
    valid: Optional[torch.utils.data.Dataset]
    setup: TrainingSetup
    train_set: Optional[torch.utils.data.Dataset] = None  # what ``train`` reads (described at the job's start)

    def validation_batches(self):
        """This DP rank's micro-batches of the whole validation set, from its start."""
        dp = self.setup.state.dp
        return build_data_loader(self.valid, self.setup.batches.micro_batch, dp.rank, dp.size, 0,
                                 pin_memory=self.setup.pin_memory)


def dataset_for_prefix(prefix: str, seq_length: int, num_samples: Optional[int], seed: int,
                       split: Tuple[float, float], data: DataConfig, eod: Optional[int]) -> torch.utils.data.Dataset:
    """The dataset over the documents ``split`` (a ``(start, end)`` fraction pair) of ``prefix``, sized
    ``num_samples`` (None: one pass): a ``PackedSFTDataset`` for ``ds-megatron preprocess --sft``'s packed rows,
    else Megatron's ``GPTDataset`` with ``data``'s pretraining flags and the tokenizer's end-of-document id
    ``eod`` (its samples carrying document fields when the job's rows pack documents, so that a blend with
    packed data batches alike).  The one place a prefix's kind picks its dataset class."""
    if is_packed_sft(prefix):
        return PackedSFTDataset(prefix, seq_length, num_samples, seed, split)
    return GPTDataset(IndexedDataset(prefix), seq_length, num_samples, seed, split, eod=eod,
                      reset_position_ids=data.reset_position_ids, eod_mask_loss=data.eod_mask_loss,
                      document_fields=data.packed_sequences)


def build_datasets(job: JobConfig, global_batch: int, valid_batch: int, consumed_samples: int = 0,
                   write_cache: bool = True):
    """``(train, valid)``: Megatron's datasets over ``data.data_path`` cut by ``data.split`` (or the embedded
    corpus), or over ``train_data_path`` / ``valid_data_path``; each a prefix's dataset or a ``BlendedDataset``.

    Sized for ``train_iters`` more steps of ``global_batch`` samples after ``consumed_samples`` (the run may have
    had another global batch before) and ``eval_iters`` of ``valid_batch``; a sample's place never depends on
    the size.  "cyclic" reads one pass of the train set, reshuffled each epoch by its sampler.  A blend's indices
    are cached in ``data.data_cache_path`` (default ``data_cache`` in the output dir); ``write_cache``: this
    rank writes them.
    """
    data, tcfg, seq_length = job.data, job.train, job.model.seq_length
    uses_eod = data.reset_position_ids or data.eod_mask_loss
    eod = data.build_tokenizer().eod if uses_eod else None
    cache_dir = data.data_cache_path or os.path.join(tcfg.output_dir, "data_cache")

    def build(prefixes: List[str], weights: Optional[List[float]], split: Tuple[float, float],
              num_samples: Optional[int], name: str):
        def make(prefix, n):
            return dataset_for_prefix(prefix, seq_length, n, tcfg.seed, split, data, eod)
        if len(prefixes) == 1:
            return make(prefixes[0], num_samples)
        description = {"split": name, "fractions": list(split), "seq_length": seq_length, "seed": tcfg.seed}
        return build_blended_dataset(prefixes, weights, num_samples, make, cache_dir, description, write_cache)[0]

    train_samples = None if data.dataloader_type == "cyclic" else consumed_samples + tcfg.train_iters * global_batch
    valid_samples = tcfg.eval_iters * valid_batch
    if data.train_data_path is not None:
        train, valid = data.blend("train_data_path"), data.blend("valid_data_path")
        return (build(train.prefixes, train.weights, (0.0, 1.0), train_samples, "train"),
                None if valid is None else build(valid.prefixes, valid.weights, (0.0, 1.0), valid_samples, "valid"))
    blend = data.blend("data_path")
    prefixes, weights = (blend.prefixes, blend.weights) if blend else ([build_default_dataset(
        max_bytes=data.default_corpus_bytes, tokenizer=data.tokenizer, eod_token=data.eod_token)], None)
    train_split, valid_split = split_fractions(data.split)[:2]
    return (build(prefixes, weights, train_split, train_samples, "train"),
            None if parse_split(data.split)[1] == 0 else build(prefixes, weights, valid_split, valid_samples, "valid"))


def build_data(job: JobConfig, setup: TrainingSetup, consumed_samples: int) -> TrainingData:
    """The datasets (``build_datasets``) and this DP rank's loader from ``consumed_samples`` on."""
    data, tcfg, dp, batches = job.data, job.train, setup.state.dp, setup.batches
    # eval_iters counts global batches (Megatron's): the same validation samples at every layout.
    train_ds, valid_ds = build_datasets(job, batches.global_batch, batches.global_batch, consumed_samples,
                                        write_cache=setup.state.world.rank == 0)
    loader = build_data_loader(train_ds, batches.micro_batch, dp.rank, dp.size, consumed_samples, data.num_workers,
                               data.dataloader_type, tcfg.seed, pin_memory=setup.pin_memory)
    return TrainingData(iter(loader), valid_ds, setup, train_ds)
