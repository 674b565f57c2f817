"""``ds-megatron train``'s job with recomputed MoE layers logs what the job without recomputation logs, bit for bit.

Two gloo ranks at EP 2, dropout on, both routing losses, a shared expert and the expert bias (aux-loss-free
balancing, moved once per step by the token counts): both runs are the same process's float32 kernels in the same
order, so every logged value (loss, routing losses, gradient norm, validation loss) is equal, step after step.  A
rerun with other dropout masks routes other tokens (its saved tensors' shapes differ: torch stops it) or computes
other gradients.  Neither a rerun's extra records nor its extra token counts would show here (a mean of each
forward twice, the sign of counts all doubled): ``tests/moe/test_moe_recompute.py`` checks both directly.
"""
import copy
import json
import os

import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
         "hidden_dropout": 0.1, "attention_dropout": 0.1, "num_experts": 4, "moe_router_topk": 2,
         "moe_aux_loss_coeff": 0.05, "moe_z_loss_coeff": 0.01, "moe_router_score_function": "sigmoid",
         "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.01,
         "moe_shared_expert_intermediate_size": 16}


def _config(out, recompute):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
            "megatron": {"expert_model_parallel_size": 2, "model": dict(MODEL, **recompute),
                         "train": {"train_iters": 3, "log_interval": 1, "lr": 3e-3, "lr_warmup_iters": 0,
                                   "eval_interval": 3, "eval_iters": 1, "output_dir": out, "seed": 3},
                         "data": {"default_corpus_bytes": 100_000, "split": "90,10"}}}


def _logs(out_dir):
    logs = {}
    for name, recompute in (("none", {}), ("full", {"recompute_granularity": "full"})):
        cfg = _config(os.path.join(out_dir, name), recompute)
        train(load_job(copy.deepcopy(cfg), dist.get_world_size()), cfg, show_progress=False)
        with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
            logs[name] = [json.loads(line) for line in f]
    return logs


def test_recomputed_moe_job_logs_the_job_without_recomputation(tmp_path):
    logs = run_on_ranks(2, _logs, str(tmp_path), timeout=300)[0]
    keys = ("loss", "load_balancing_loss", "z_loss", "grad_norm", "val_loss")
    want = [{k: r[k] for k in keys if k in r} for r in logs["none"]]
    assert sum("load_balancing_loss" in r for r in want) == 3 and any("val_loss" in r for r in want), want
    assert [{k: r[k] for k in keys if k in r} for r in logs["full"]] == want
