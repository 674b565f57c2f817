"""Stopping and restarting as clusters do, with real launchers and real processes.

* SIGTERM to a 4-rank job started through ``launch/deepspeed_cpu.sh`` (the deepspeed runner, which
  does not forward the signal and dies alone): the ranks notice, agree on a step, save, flush and exit
  0; resumed (in-process, 4 ranks), the run's losses equal an unbroken run's bit for bit.
* SIGKILL of a whole job in the middle of writing a checkpoint: ``latest`` still names the previous,
  complete one, and the job resumes from it with the unbroken run's losses.
"""
import json
import os
import subprocess

import pytest
import sys

from harness import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def _config(out_dir, steps, tp=2, **train):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": tp,
            "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16,
                      "vocab_size": 257, "hidden_dropout": 0.1, "attention_dropout": 0.1},
            "train": {"train_iters": steps, "lr": 3e-3, "lr_decay_style": "constant", "lr_warmup_iters": 0,
                      "eval_interval": 10 ** 6, "eval_iters": 1, "output_dir": out_dir, **train},
            "data": {"default_corpus_bytes": 200_000, "split": "90,10"},
        },
    }


def _env():
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONUNBUFFERED="1")
    return env


def _write(tmp_path, name, cfg):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _losses(metrics_path):
    return {m["step"]: m["loss"] for m in map(json.loads, open(metrics_path)) if "loss" in m}


def _drive(tmp_path, watch, trigger, action, command, env=None):
    result = tmp_path / f"{action}.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "launcher_driver.py"), str(result), watch, trigger,
                           action, "--", *command], cwd=ROOT, env=env or _env(), capture_output=True, text=True,
                          timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(result.read_text()), proc.stdout + proc.stderr


def _train(cfg, stop_after, resume=False):
    import torch.distributed as dist
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    return train(load_job(cfg, dist.get_world_size()), cfg, resume=resume, stop_after=stop_after,
                 show_progress=False).losses


def test_sigterm_to_the_deepspeed_launcher_stops_4_ranks_gracefully_and_they_resume_bit_exact(tmp_path):
    run = str(tmp_path / "run")
    cfg = _config(run, steps=2000)
    launch = ["bash", "launch/deepspeed_cpu.sh", "4", "-m", "ds_megatron.cli", "train", "--config"]
    report, output = _drive(tmp_path, os.path.join(run, "metrics.jsonl"), "step:3", "sigterm-launcher",
                            launch + [_write(tmp_path, "cfg.json", cfg)])
    assert report["launcher"] == -15  # the runner died of the signal itself
    # Orphaned, DeepSpeed's launch.py was reparented to the driver: it exits 0 only if every rank did.
    others = [code for pid, code in report["statuses"].items() if int(pid) != report["launcher_pid"]]
    assert others == [0], report
    stopped = int(open(os.path.join(run, "latest")).read().strip()[len("iter_"):])
    assert 3 <= stopped < 2000
    assert f"stopping after step {stopped} (the deepspeed launcher ended): checkpoint" in output, output[-3000:]
    first = _losses(os.path.join(run, "metrics.jsonl"))
    assert sorted(first) == list(range(1, stopped + 1))

    # Resume on 4 ranks for 3 more steps (exit_interval stops it there), then the unbroken run.  In-process: a
    # launcher's --resume is the kill-while-saving test's, and each 4-rank launch costs CI time.
    end = stopped + 3
    run_on_ranks(4, _train, _config(run, steps=2000, exit_interval=end), None, True)
    both = _losses(os.path.join(run, "metrics.jsonl"))
    assert sorted(both) == list(range(1, end + 1))
    unbroken = run_on_ranks(4, _train, _config(str(tmp_path / "unbroken"), steps=2000), end)[0]
    assert both == unbroken  # bit-exact: data position, RNG streams, optimizer state all restored


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "deepspeed"])
def test_a_job_killed_while_saving_leaves_latest_on_the_previous_checkpoint(tmp_path, ckpt_format):
    run = str(tmp_path / "run")
    cfg = _config(run, steps=6, save_interval=2)
    cfg["megatron"]["train"]["ckpt_format"] = ckpt_format
    marker = str(tmp_path / "blocked")
    env = dict(_env(), BLOCK_TAG="iter_0000004", BLOCK_MARKER=marker)
    report, output = _drive(tmp_path, marker, "exists", "sigkill-all",
                            ["bash", "launch/torchrun.sh", "2", os.path.join(HERE, "slow_save_job.py"),
                             "--config", _write(tmp_path, "cfg.json", cfg)], env=env)
    assert all(code == -9 for code in report["statuses"].values()), report
    assert open(os.path.join(run, "latest")).read() == "iter_0000002"  # not the half-written iter_0000004
    assert os.path.isdir(os.path.join(run, "iter_0000004"))
    if ckpt_format == "torch_dist":  # --resume through the launcher once; the other format in-process (CI time)
        proc = subprocess.run(["bash", "launch/torchrun.sh", "2", "-m", "ds_megatron.cli", "train", "--config",
                               _write(tmp_path, "cfg.json", cfg), "--resume"], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        run_on_ranks(2, _train, cfg, None, True)
    assert open(os.path.join(run, "latest")).read() == "iter_0000006"
    losses = _losses(os.path.join(run, "metrics.jsonl"))
    unbroken = run_on_ranks(2, _train, _config(str(tmp_path / "unbroken"), steps=6, save_interval=2), None)[0]
    assert losses == unbroken
