"""The checkpoints of a run directory, torch-free: tags, ``latest`` (written atomically), what a checkpoint
records about its job, the checks ``--resume`` makes before anything starts, and pruning old checkpoints.

``checkpointing.api.save`` writes ``JOB_META`` into every checkpoint directory (rank 0,
before ``latest`` moves to it): the model's shape fields, the parallel sizes that name the
checkpoint's files, the parameter dtype and the settings the sample order depends on (the
datasets, the split, the seed, the sampler; ``seq_length`` is a model field).  ``check_resume``
compares them with the job that resumes and raises a ``ConfigError`` naming the first field that
differs, before any process group exists and before any file is written.  The data-parallel size
may differ (our optimizer states are saved DP-independent) except where DeepSpeed's optimizer cuts its
state by it (``dp_cut_optimizer``), and so may the global batch: the samples consumed are counted
globally, so the resumed run reads on from the next sample.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional

from ..config import SECTION, ConfigError
from ..config.pipeline import pipeline_runtime

LATEST = "latest"
JOB_META = "ds_megatron_job.json"
_TAG = re.compile(r"^iter_(\d{7})$")

# Model fields that change a parameter's shape or name; a checkpoint only loads into the same values.
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                      "vocab_size", "make_vocab_size_divisible_by", "num_experts", "moe_ffn_hidden_size",
                      "moe_layer_freq", "moe_shared_expert_ffn_hidden_size", "moe_grouped_gemm")
# The parallel sizes a checkpoint's files are named and cut by (Megatron's names, as in the section).
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")
# The settings the data order depends on (besides model.seq_length), as "section.key" of the megatron section.
DATA_ORDER_FIELDS = ("data.data_path", "data.train_data_path", "data.split", "data.dataloader_type", "train.seed")
# What the embedded corpus is made of, recorded when the job trains on it.
CORPUS_FIELDS = ("data.default_corpus_bytes", "data.tokenizer", "data.eod_token")


def tag_for(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(tag: str) -> Optional[int]:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def latest_tag(save_dir: str) -> Optional[str]:
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def job_meta(job) -> Dict[str, Any]:
    """What a checkpoint records about the job that wrote it (``job``: a ``JobConfig``)."""
    parallel = job.megatron.parallel
    return {"model": {f: getattr(job.model, f) for f in MODEL_SHAPE_FIELDS},
            "layout": {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
                       "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
                       "expert_model_parallel_size": parallel.expert_model_parallel_size,
                       "expert_tensor_parallel_size": (parallel.expert_tensor_parallel_size
                                                       or parallel.tensor_model_parallel_size)},
            "params_dtype": job.megatron.precision.params_dtype,
            "fp8_amax_history_len": delayed_history_len(job.model),
            "ckpt_format": job.train.ckpt_format,
            "data_parallel_size": job.megatron.parallel.layout(job.world_size).dp if job.world_size else None,
            "dp_cut_optimizer": dp_cut_optimizer(job),
            "data_order": data_order(job)}


def dp_cut_optimizer(job) -> Optional[str]:
    """DeepSpeed's optimizer that keeps one part of its state per data-parallel rank, which DeepSpeed loads only at
    the data-parallel size it was saved at (None: the job's optimizer state loads at any size)."""
    megatron = job.megatron
    if megatron.optimizer_impl == "megatron":
        return None
    zero_stage = megatron.deepspeed_batch.zero_stage
    if zero_stage:
        return f"ZeRO stage {zero_stage}"
    pp = megatron.parallel.pipeline_model_parallel_size
    if megatron.precision.params_dtype == "bf16" and pp > 1 and \
            pipeline_runtime(megatron.parallel, megatron.optimizer_impl) == "deepspeed":
        return "DeepSpeed's BF16_Optimizer (bf16 on its PipelineEngine)"
    return None


def delayed_history_len(model) -> Optional[int]:
    """The length of the delayed fp8 recipe's amax histories a checkpoint holds (None: it holds none)."""
    return model.fp8_amax_history_len if model.fp8 is not None and model.fp8_recipe == "delayed" else None


def data_order(job) -> Dict[str, Any]:
    """The settings the job's sample order depends on, by ``section.key`` (``DATA_ORDER_FIELDS``, and
    ``CORPUS_FIELDS`` when it trains on the embedded corpus)."""
    corpus = job.data.data_path is None and job.data.train_data_path is None
    fields = DATA_ORDER_FIELDS + (CORPUS_FIELDS if corpus else ())
    return {name: getattr(getattr(job.megatron, name.split(".")[0]), name.split(".")[1]) for name in fields}


def write_job_meta(save_dir: str, tag: str, meta: Dict[str, Any]) -> None:
    write_atomic(os.path.join(save_dir, tag, JOB_META), json.dumps(meta, indent=1, sort_keys=True))


def read_job_meta(save_dir: str, tag: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(save_dir, tag, JOB_META)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_resume(job, save_dir: str) -> Optional[str]:
    """The tag ``--resume`` will load (None: there is no checkpoint); a ConfigError when it does not fit ``job``."""
    tag = latest_tag(save_dir)
    if tag is None:
        return None
    where = os.path.join(save_dir, tag)
    if not os.path.isdir(where):
        raise ConfigError(f"{os.path.join(save_dir, LATEST)} names {tag!r}, which does not exist; point it at a "
                          "checkpoint directory in the output dir, or use another --output-dir")
    saved = read_job_meta(save_dir, tag)
    if saved is None:  # written before ds_megatron recorded its job: nothing to compare
        return tag
    now = job_meta(job)
    for name in MODEL_SHAPE_FIELDS:
        if name in saved["model"] and saved["model"][name] != now["model"][name]:
            raise ConfigError(f"{SECTION}.model.{name}={now['model'][name]!r} but the checkpoint {where} was saved "
                              f"with {name}={saved['model'][name]!r}; resume with the same value, or use another "
                              "--output-dir to start a new run")
    # A torch_dist checkpoint stores every tensor by its place in the whole model: any layout reads it.
    for name in LAYOUT_FIELDS if saved.get("ckpt_format", "deepspeed") != "torch_dist" else ():
        if name in saved["layout"] and saved["layout"][name] != now["layout"][name]:
            raise ConfigError(f"{SECTION}.{name}={now['layout'][name]} but the checkpoint {where} was saved with "
                              f"{saved['layout'][name]} (its files are cut by it); resume with the same size (the "
                              "data-parallel size may change), or use another --output-dir (checkpoints saved with "
                              f"{SECTION}.train.ckpt_format \"torch_dist\" resume at any layout)")
    cut_by = saved.get("dp_cut_optimizer")
    if cut_by and now["data_parallel_size"] not in (None, saved["data_parallel_size"]):
        raise ConfigError(f"the data-parallel size is {now['data_parallel_size']} but the checkpoint {where} was "
                          f"saved at {saved['data_parallel_size']}, where {cut_by} kept one part of the optimizer "
                          "state per data-parallel rank, which DeepSpeed loads at that size only; resume on "
                          f"{saved['data_parallel_size']} data-parallel ranks, or use another --output-dir")
    if saved.get("params_dtype", now["params_dtype"]) != now["params_dtype"]:
        raise ConfigError(f"this config trains {now['params_dtype']} params (fp16.enabled / bf16.enabled) but the "
                          f"checkpoint {where} holds {saved['params_dtype']} ones with their optimizer state; resume "
                          "with the same precision, or use another --output-dir")
    history = saved.get("fp8_amax_history_len")
    if history is not None and now["fp8_amax_history_len"] not in (None, history):
        raise ConfigError(f"{SECTION}.model.fp8_amax_history_len={now['fp8_amax_history_len']} but the checkpoint "
                          f"{where} holds the delayed fp8 recipe's amax histories of {history} steps; resume with "
                          f"{history}, or use another --output-dir")
    # Checkpoints written before the data order was recorded have none to compare.
    saved_order, now_order = saved.get("data_order", {}), now["data_order"]
    for name in DATA_ORDER_FIELDS + CORPUS_FIELDS:
        if name in saved_order and saved_order[name] != now_order.get(name):
            raise ConfigError(f"{SECTION}.{name}={now_order.get(name)!r} but the checkpoint {where} was saved with "
                              f"{saved_order[name]!r}, and the order of the samples depends on it; resume with the "
                              "same value, or use another --output-dir to start a new run")
    return tag


def prune_checkpoints(save_dir: str, keep: int) -> List[str]:
    """Remove all but the ``keep`` newest ``iter_*`` checkpoints (never the one ``latest`` names); returns
    the removed tags.  ``keep`` 0 keeps everything."""
    if keep < 1:
        return []
    protected = latest_tag(save_dir)
    tags = sorted((t for t in os.listdir(save_dir) if step_of(t) is not None and
                   os.path.isdir(os.path.join(save_dir, t))), key=step_of)
    removed = [t for t in tags[:-keep] if t != protected]
    for tag in removed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return removed


__all__ = ["JOB_META", "LATEST", "check_resume", "job_meta", "latest_tag", "prune_checkpoints", "read_job_meta",
           "step_of", "tag_for", "write_atomic", "write_job_meta"]
