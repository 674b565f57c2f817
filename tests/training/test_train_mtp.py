"""Multi-token prediction through ``ds-megatron train`` with pipeline parallelism: the MTP layers on the last
stage (our runtime hands it the tokens), and the log.  PP = 2 logs what PP = 1 logs for the same job: the loss
(LM loss + ``mtp_loss_scaling_factor`` x MTP loss + routing losses, however the stages hold them), the MTP loss
and the routing losses, and the validation loss.  Over three float32 steps the two runs stay ~1e-6 apart; what
this guards against is of the size of a loss (the MTP loss added twice, or an evaluation's mixed into the
training log: 1e-2 and more)."""
import json
import os

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.3,
         "num_experts": 2, "moe_router_topk": 1, "moe_aux_loss_coeff": 0.05, "moe_layer_freq": [0, 1]}


def _config(out, pp):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 6,
            "megatron": {"pipeline_model_parallel_size": pp, "model": MODEL,
                         "train": {"train_iters": 3, "log_interval": 1, "lr": 3e-3, "lr_warmup_iters": 0,
                                   "eval_interval": 2, "eval_iters": 1, "output_dir": out, "seed": 3},
                         "data": {"default_corpus_bytes": 200_000, "split": "90,10"}}}


def _train_and_log(cfg):
    train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False)
    with open(os.path.join(cfg["megatron"]["train"]["output_dir"], "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_pp2_logs_the_losses_of_pp1(tmp_path):
    one = run_on_ranks(1, _train_and_log, _config(str(tmp_path / "pp1"), 1))[0]
    two = run_on_ranks(2, _train_and_log, _config(str(tmp_path / "pp2"), 2))[0]
    keys = ("loss", "mtp_loss", "load_balancing_loss", "val_loss")
    want = [{k: r[k] for k in keys if k in r} for r in one if any(k in r for k in keys)]
    got = [{k: r[k] for k in keys if k in r} for r in two if any(k in r for k in keys)]
    assert [sorted(r) for r in got] == [sorted(r) for r in want] and len(want) == 6, (got, want)  # 3 steps; evaluated at 0, 2, 3
    for g, w in zip(got, want):
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-4), (k, got, want)
