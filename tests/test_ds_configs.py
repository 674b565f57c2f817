"""Every shipped config validates and trains a few steps through the real job on 4 gloo ranks."""
import glob
import math
import os

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.training.train import load_job, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))


def _few_steps(path, out_dir):
    job = load_job(path, dist.get_world_size(), train_iters=3, output_dir=out_dir)
    job.train.eval_iters = 1
    job.data.default_corpus_bytes = 1_000_000
    res = train(job, path, show_progress=False)
    return res.losses


def test_configs_are_shipped():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"gpt_cpu_tp2_dp2.json", "gpt_tp1.json", "gpt_tp4.json", "gpt_tp2_sp.json", "moe_ep2.json",
            "moe_ep4_tp2.json", "gpt_bf16_tp2_dp2.json", "gpt_fp16_tp2_dp2.json", "gpt_distopt_tp2_dp2.json",
            "gpt_cuda_graphs.json"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_config_trains_on_four_ranks(path, tmp_path):
    losses = run_on_ranks(4, _few_steps, path, str(tmp_path))
    for rank_losses in losses:
        assert sorted(rank_losses) == [1, 2, 3]
        assert all(math.isfinite(v) for v in rank_losses.values())
    assert losses[0] == losses[1] == losses[2] == losses[3]
