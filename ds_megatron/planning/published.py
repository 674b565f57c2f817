"""Published training runs the step-time model is checked against (``tests/test_plan_time.py``,
``docs/performance.md``): predicted next to published, with no per-row constant (pure, no torch).

* Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21),
  Table 1: A100 80GB, seq 2048, vocab 51200, full recomputation, TFLOP/s per GPU counted by their eq. 3
  (``flops.narayanan_flops``); the micro-batch is not published: the fastest of 1, 2, 4, 8 that fits memory.
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), Table 5: A100,
  seq 2048, vocab 51200, micro-batch 1, the iteration time with full recomputation and with sequence
  parallelism plus selective recomputation.

Both ran Megatron-LM of their day: attention scores materialized (softmax and dropout through memory, no flash
kernel), the reentrant checkpoint rerunning the whole layer, the data-parallel reduction after the backward, and
fp16 (bf16 here: the same peak and bytes).  The runs are planned on ``A100_2021``: the ``a100`` profile with that
attention kernel.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ..config.job import parse_job_config
from ..errors import ConfigError
from .flops import narayanan_flops
from .hardware import A100
from .job_plan import plan_from_config, run_from_job
from .step_time import plan_step_time

A100_2021 = dataclasses.replace(A100, name="a100 (2021 kernels)", attention_kernel="materialized")
SEQ, VOCAB = 2048, 51200

# (parameters, hidden, layers, heads, tp, pp, gpus, global batch, published TFLOP/s per GPU)
NARAYANAN_TABLE_1 = [
    ("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137), ("3.6B", 3072, 30, 32, 2, 1, 64, 512, 138),
    ("7.5B", 4096, 36, 32, 4, 1, 128, 512, 142), ("18.4B", 6144, 40, 48, 8, 1, 256, 1024, 135),
    ("39.1B", 8192, 48, 64, 8, 2, 512, 1536, 138), ("76.1B", 10240, 60, 80, 8, 4, 1024, 1792, 140),
    ("145.6B", 12288, 80, 96, 8, 8, 1536, 2304, 148), ("310.1B", 16384, 96, 128, 8, 16, 1920, 2160, 155),
    ("529.6B", 20480, 105, 128, 8, 35, 2520, 2520, 163), ("1008B", 25600, 128, 160, 8, 64, 3072, 3072, 163)]
# (parameters, hidden, layers, heads, tp, pp, interleaved chunks, gpus, global batch, full s, selective + SP s)
KORTHIKANTI_TABLE_5 = [
    ("22B", 6144, 48, 64, 8, 1, 1, 8, 4, 1.42, 1.10), ("175B", 12288, 96, 96, 8, 8, 3, 64, 64, 18.13, 13.75),
    ("530B", 20480, 105, 128, 8, 35, 3, 280, 280, 49.05, 37.83),
    ("1T", 25600, 128, 160, 8, 64, 1, 512, 512, 94.42, 71.49)]


def paper_config(hidden: int, layers: int, heads: int, tp: int, pp: int, vpp: int, micro_batch: int,
                 micro_batches: int, recompute: str) -> Dict:
    """The job config of a published run: GPT-3's architecture, dropout 0.1, Megatron's recomputation."""
    model = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=SEQ, vocab_size=VOCAB,
                 hidden_dropout=0.1, attention_dropout=0.1)
    if recompute == "full":
        model.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    else:
        model.update(recompute_granularity="selective")
    megatron = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, model=model,
                    sequence_parallel=recompute == "selective" and tp > 1)
    if vpp > 1:
        megatron.update(virtual_pipeline_model_parallel_size=vpp, pipeline_schedule="interleaved_1f1b")
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
            "bf16": {"enabled": True}, "megatron": megatron}


def predict(config: Dict, world: int, check_memory: bool = True) -> Optional[float]:
    """The predicted step of a published run on ``A100_2021`` (None when the plan's peak exceeds its memory)."""
    job = parse_job_config(config)
    if check_memory:
        _, plans, _ = plan_from_config(job, world)
        if max(p.total_bytes for p in plans) > A100_2021.memory_bytes:
            return None
    run = dataclasses.replace(run_from_job(job, world), recompute_whole_layer=True)
    return plan_step_time(run, A100_2021).step_time_s


def narayanan_rows() -> List[Dict]:
    """Table 1, predicted next to published (TFLOP/s per GPU by their formula)."""
    out = []
    for name, h, layers, heads, tp, pp, gpus, batch, published in NARAYANAN_TABLE_1:
        dp = gpus // (tp * pp)
        steps = {}
        for mb in (1, 2, 4, 8):
            if (batch // dp) % mb == 0:
                step = predict(paper_config(h, layers, heads, tp, pp, 1, mb, batch // (dp * mb), "full"), gpus)
                if step is not None:
                    steps[mb] = step
        if not steps:
            raise ConfigError(f"{name}: no micro-batch of 1, 2, 4, 8 fits the plan's memory")
        mb = min(steps, key=steps.get)
        predicted = narayanan_flops(batch, SEQ, layers, h, VOCAB) / (steps[mb] * gpus) / 1e12
        out.append(dict(model=name, tp=tp, pp=pp, gpus=gpus, batch=batch, micro_batch=mb, published=published,
                        predicted=predicted, error=predicted / published - 1))
    return out


def korthikanti_rows() -> List[Dict]:
    """Table 5, predicted next to published (iteration seconds), both recomputations."""
    out = []
    for name, h, layers, heads, tp, pp, vpp, gpus, batch, full, selective in KORTHIKANTI_TABLE_5:
        dp = gpus // (tp * pp)
        for recompute, published in (("full", full), ("selective", selective)):
            predicted = predict(paper_config(h, layers, heads, tp, pp, vpp, 1, batch // dp, recompute), gpus,
                                check_memory=False)
            out.append(dict(model=name, tp=tp, pp=pp, vpp=vpp, gpus=gpus, batch=batch, recompute=recompute,
                            published=published, predicted=predicted, error=predicted / published - 1))
    return out
