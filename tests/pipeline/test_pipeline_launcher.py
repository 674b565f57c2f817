"""``ds-megatron train`` through the ``deepspeed`` launcher: TP=2 x PP=2 on our pipeline runtime with Megatron's
interleaved 1F1B (v = 2) follows TP=2 x DP=2 (run in-process) step for step.  (v = 1 and the other schedules against the one-rank
model: ``test_pipeline_equivalence.py``, in-process; each 4-rank launch here costs CI time.)

Both jobs take the shipped configs (``gpt_tp2_pp2.json``, ``gpt_cpu_tp2_dp2.json``)
with a shorter run: 4 ranks each, the same model from the same seed, the same
16 sequences per step (PP: 4 micro-batches of 4 on one pipeline; DP: 8 on
each of two replicas) and the same 32 validation sequences.  The training and
validation losses must agree.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10


def _short(name, tmp_path, **megatron):
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        cfg = json.load(f)
    cfg["megatron"].update(megatron)
    cfg["megatron"]["model"].update(num_layers=4, hidden_size=64, seq_length=64)
    # The same 32 validation sequences for both layouts: eval_iters counts global batches (16 sequences in both).
    cfg["megatron"]["train"].update(train_iters=STEPS, eval_interval=STEPS, eval_iters=2, save_interval=0,
                                    log_interval=5)
    cfg["megatron"]["data"].update(default_corpus_bytes=1_000_000, split="90,10")
    path = tmp_path / (name if not megatron else f"v_{name}")
    path.write_text(json.dumps(cfg))
    return str(path)


def _launch(config, out, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "launch/deepspeed_cpu.sh", "4", "-m", "ds_megatron.cli", "train", "--config",
                           config, "--output-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    return losses, val


def _train_here(config, out):
    import torch.distributed as dist
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    result = train(load_job(config, dist.get_world_size(), None, out), config, show_progress=False)
    return result.losses, result.val_losses


def test_tp2_pp2_follows_tp2_dp2_through_the_launcher(tmp_path):
    """Our runtime with Megatron's interleaved 1F1B over 2 chunks per rank.  The TP=2 x DP=2 reference runs on the
    test harness's 4 gloo ranks (the same training code; one launch less)."""
    from harness import run_on_ranks
    dp_losses, dp_val = run_on_ranks(4, _train_here, _short("gpt_cpu_tp2_dp2.json", tmp_path), str(tmp_path / "dp"))[0]
    for name, megatron in (("pp_v2", {"virtual_pipeline_model_parallel_size": 2}),):
        pp_losses, pp_val = _launch(_short("gpt_tp2_pp2.json", tmp_path, **megatron), tmp_path / name, tmp_path)
        assert sorted(pp_losses) == sorted(dp_losses) == list(range(1, STEPS + 1))
        for step in pp_losses:
            assert pp_losses[step] == pytest.approx(dp_losses[step], rel=2e-4), (name, step)
        assert sorted(pp_val) == sorted(dp_val) == [0, STEPS]
        for step in pp_val:
            assert pp_val[step] == pytest.approx(dp_val[step], rel=2e-4), (name, step)
        assert pp_losses[STEPS] < pp_losses[1]
