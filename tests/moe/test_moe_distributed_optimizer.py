"""MoE (folded) with Megatron's gradient buffers and the distributed optimizer through the real job: same
losses and grad norms as the plain path with clipping active on every step, and (distributed optimizer)
a checkpoint save that does not hang (DeepSpeed asks only the expert-data-parallel writers for the
optimizer state) and resumes to the same losses."""
import copy
import json
import os

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cfg, out_dir, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size(), train_iters=5, output_dir=out_dir)
    job.train.eval_iters = 1
    job.train.save_interval = 5
    job.data.default_corpus_bytes = 1_000_000
    losses = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False).losses
    norms = None
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            norms = [r["grad_norm"] for r in map(json.loads, f) if "grad_norm" in r]
    return losses, norms


@pytest.mark.parametrize("config,megatron", [
    ("moe_ep4_tp2.json", {"use_distributed_optimizer": True, "bucket_size": 20_000}),
    ("moe_ep2.json", {"use_distributed_optimizer": True, "bucket_size": 20_000}),
    ("moe_ep4_tp2.json", {"overlap_grad_reduce": True, "bucket_size": 20_000}),  # Megatron DDP, no sharding
])
def test_grad_buffers_and_distributed_optimizer_match_the_plain_path_with_experts(config, megatron, tmp_path):
    with open(os.path.join(ROOT, "ds_configs", config)) as f:
        base = json.load(f)
    base["megatron"]["model"].update(num_layers=2, hidden_size=64, seq_length=64)
    base["train_micro_batch_size_per_gpu"] = 2
    base["gradient_clipping"] = 0.05  # below every step's norm: clipping is active throughout
    dist_cfg = copy.deepcopy(base)
    dist_cfg["megatron"].update(megatron)
    ref_losses, ref_norms = run_on_ranks(4, _run, base, str(tmp_path / "ref"))[0]
    losses, norms = run_on_ranks(4, _run, dist_cfg, str(tmp_path / "dist"))[0]
    assert min(ref_norms) > 0.05
    for step in ref_losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5), step
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert os.path.isfile(tmp_path / "dist" / "iter_0000005" / ".metadata")  # the job's torch_dist checkpoint
    if not megatron.get("use_distributed_optimizer"):
        return
    # Interrupt after step 3 (saved there), resume: steps 4 and 5 as in the uninterrupted run.
    run_on_ranks(4, _run, dist_cfg, str(tmp_path / "cut"), False, 3)
    resumed, _ = run_on_ranks(4, _run, dist_cfg, str(tmp_path / "cut"), True)[0]
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-6), step
