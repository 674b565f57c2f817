"""The training job refuses to report success on a wrong run, and follows the conventions clusters and
DeepSpeed users rely on: on 2 gloo ranks (TP=2) with a tiny GPT.

* token ids at or above vocab_size: one line naming both numbers, before any rank trains;
* a loss that is no longer finite: the job stops (exit code 3 from the CLI), metrics.jsonl stays strict JSON;
* --resume without a checkpoint: one line and a fresh metrics file; --resume on a checkpoint of another
  model or layout: one line naming the field;
* exit_interval, exit_duration_in_mins and SIGUSR1: every rank stops at the same step, with a checkpoint;
* keep_last_n_checkpoints; DeepSpeed's csv_monitor gets the metrics; the log line's fields.
"""
import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch.distributed as dist

from harness import run_on_ranks
from nonfinite_job import infinite_after
from ds_megatron.config import ConfigError
from ds_megatron.errors import NonFiniteLossError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp, steps=4, **train):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": 2,
            "model": {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16,
                      "vocab_size": 257, "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "train": {"train_iters": steps, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 1, "eval_interval": 100,
                      "eval_iters": 1, "output_dir": os.path.join(tmp, "run"), **train},
            "data": {"default_corpus_bytes": 200_000, "split": "90,10"},
        },
    }


def _strict_lines(path):
    def reject(name):
        raise ValueError(f"{name} is not strict JSON")
    return [json.loads(line, parse_constant=reject) for line in open(path)]


def _run(cfg, resume=False, stop_after=None, show_progress=False):
    """The job on these ranks: (losses, stop reason, what rank 0 printed); a ConfigError's message instead."""
    from ds_megatron.config.job import load_job
    from ds_megatron.training.train import train
    out = io.StringIO()
    try:
        job = load_job(cfg, dist.get_world_size())
        with contextlib.redirect_stdout(out):
            res = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=show_progress)
    except ConfigError as e:
        return str(e)
    return res.losses, res.stop_reason, out.getvalue()


# --- item 3: the data against the model, non-finite losses, strict JSON ---------------------------------

def test_token_ids_at_or_above_vocab_size_fail_at_start_naming_both_numbers(tmp_path):
    from ds_megatron.data.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "big_ids")
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(50):
            b.add_document(list(range(0, 400, 3)))  # ids up to 399; the model has 257
    cfg = _config(str(tmp_path))
    cfg["megatron"]["data"]["data_path"] = prefix
    for msg in run_on_ranks(2, _run, cfg):
        assert msg == (f"megatron.data.data_path={prefix!r} holds token id 399 but megatron.model.vocab_size=257 "
                       "(ids must be below it); set vocab_size to at least 400 or rebuild the data with the model's "
                       "tokenizer")
    cfg["megatron"]["model"]["vocab_size"] = 400
    losses, _, _ = run_on_ranks(2, _run, cfg)[0]
    assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(list(losses.values())))


def _nonfinite_after(cfg, good_steps):
    """The job with a model whose loss turns infinite after ``good_steps`` steps."""
    import ds_megatron.training.build as build

    real, build.GPTModel = build.GPTModel, infinite_after(build.GPTModel, good_steps)
    try:
        return _run(cfg)
    except NonFiniteLossError as e:
        return f"stopped: {e}"
    finally:
        build.GPTModel = real


def test_a_loss_that_is_no_longer_finite_stops_the_job_and_metrics_stay_strict_json(tmp_path):
    cfg = _config(str(tmp_path / "a"), steps=10, max_consecutive_nonfinite_steps=2, log_interval=2)
    for msg in run_on_ranks(2, _nonfinite_after, cfg, 3):
        assert msg.startswith("stopped: step 5: the loss is inf, 2 step(s) in a row "
                              "(megatron.train.max_consecutive_nonfinite_steps=2); stopping"), msg
    lines = _strict_lines(os.path.join(str(tmp_path / "a"), "run", "metrics.jsonl"))
    train = [m for m in lines if "loss" in m]
    # Every step that ran is recorded (the bad ones with null and a "nonfinite" entry), none after the stop.
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] is None for m in train] == [False, False, False, True, True, True]
    assert train[-1]["nonfinite"] == {"loss": "inf"} and train[-1]["skipped_steps"] == 3
    assert not os.path.exists(os.path.join(str(tmp_path / "a"), "run", "latest"))  # no checkpoint of a broken run

    # The check off: the run goes on to the end (and still writes strict JSON).
    cfg = _config(str(tmp_path / "b"), steps=5, check_for_nan_in_loss_and_grad=False)
    losses, _, _ = run_on_ranks(2, _nonfinite_after, cfg, 3)[0]
    assert sorted(losses) == [1, 2, 3, 4, 5] and losses[5] == float("inf")
    assert len(_strict_lines(os.path.join(str(tmp_path / "b"), "run", "metrics.jsonl"))) == 7  # + 2 validations


def test_the_cli_exits_non_zero_when_the_loss_stays_non_finite(tmp_path):
    cfg = _config(str(tmp_path), steps=6)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", NONFINITE_AFTER="2")
    proc = subprocess.run(["bash", "launch/torchrun.sh", "2", os.path.join(ROOT, "tests", "training",
                                                                           "nonfinite_job.py"), "--config", str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "ds-megatron train: error: step 3: the loss is inf" in proc.stderr, proc.stderr[-3000:]


# --- item 6: --resume ------------------------------------------------------------------------------------

def test_resume_without_a_checkpoint_says_so_and_starts_a_fresh_metrics_file(tmp_path):
    cfg = _config(str(tmp_path), steps=2)
    run = os.path.join(str(tmp_path), "run")
    os.makedirs(run)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # an old run's file, no checkpoint
    losses, _, printed = run_on_ranks(2, _run, cfg, True, None, True)[0]
    assert sorted(losses) == [1, 2]
    assert f"--resume: no checkpoint in {run} (no latest file); starting at step 0" in printed
    assert f"the earlier metrics.jsonl is now {os.path.join(run, 'metrics.jsonl.1')}" in printed
    assert [m["step"] for m in _strict_lines(os.path.join(run, "metrics.jsonl")) if "loss" in m] == [1, 2]
    assert _strict_lines(os.path.join(run, "metrics.jsonl.1")) == [{"step": 1, "loss": 9.0}]


def test_resume_on_a_checkpoint_of_another_model_or_layout_names_the_field(tmp_path):
    cfg = _config(str(tmp_path), steps=2)
    cfg["megatron"]["train"]["ckpt_format"] = "deepspeed"  # cut by its layout (torch_dist: tests/training/test_dist_checkpoint.py)
    run_on_ranks(2, _run, cfg)
    other = json.loads(json.dumps(cfg))
    other["megatron"]["model"]["vocab_size"] = 300
    for msg in run_on_ranks(2, _run, other, True):
        assert msg.startswith("megatron.model.vocab_size=300 but the checkpoint ") and "vocab_size=257" in msg, msg
    other = json.loads(json.dumps(cfg))
    other["megatron"]["tensor_model_parallel_size"] = 1
    msg = run_on_ranks(2, _run, other, True)[0]
    assert msg.startswith("megatron.tensor_model_parallel_size=1 but the checkpoint ") and "saved with 2" in msg
    assert 'ckpt_format "torch_dist"' in msg  # the way to a checkpoint any layout resumes
    other = json.loads(json.dumps(cfg))
    other["bf16"] = {"enabled": True}
    assert "trains bf16 params (fp16.enabled / bf16.enabled)" in run_on_ranks(2, _run, other, True)[0]
    # The CLI says it in one line with exit code 2, before torch is imported.
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other))
    proc = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "train", "--config", str(path), "--resume"],
                          capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "2"}, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "trains bf16 params" in proc.stderr


# --- item 7: stopping on schedule and on signals -----------------------------------------------------------

def _signal_at(cfg, step, signum):
    """The job, rank 1 sending itself ``signum`` when step ``step`` ends."""
    import ds_megatron.training.train as loop
    real = loop.StopRequest.check

    def check(self, s):
        if s == step and dist.get_rank() == 1:
            os.kill(os.getpid(), signum)
        return real(self, s)
    loop.StopRequest.check = check
    try:
        return _run(cfg, show_progress=True)
    finally:
        loop.StopRequest.check = real


def test_exit_interval_duration_and_signals_stop_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    cfg = _config(str(tmp_path / "interval"), steps=10, exit_interval=3)
    for losses, reason, _ in run_on_ranks(2, _run, cfg):
        assert sorted(losses) == [1, 2, 3] and reason == "exit_interval=3 reached"
    assert open(os.path.join(str(tmp_path / "interval"), "run", "latest")).read() == "iter_0000003"

    cfg = _config(str(tmp_path / "duration"), steps=10, exit_duration_in_mins=1e-9)
    for losses, reason, _ in run_on_ranks(2, _run, cfg):
        assert sorted(losses) == [1] and reason == "exit_duration_in_mins=1e-09 reached"

    cfg = _config(str(tmp_path / "usr1"), steps=10)
    out = run_on_ranks(2, _signal_at, cfg, 2, signal.SIGUSR1)
    assert [sorted(o[0]) for o in out] == [[1, 2], [1, 2]]
    assert out[1][1] == out[0][1] == "SIGUSR1"  # rank 1 got it, rank 0 learnt it at the step boundary
    assert "stopping after step 2 (SIGUSR1): checkpoint iter_0000002 saved" in out[0][2]
    assert open(os.path.join(str(tmp_path / "usr1"), "run", "latest")).read() == "iter_0000002"
    # The handlers were put back: the worker processes keep their own.
    assert run_on_ranks(2, signal.getsignal, signal.SIGTERM) == [signal.SIG_DFL] * 2


# --- item 8: keep_last_n_checkpoints ---------------------------------------------------------------------

def test_keep_last_n_checkpoints_prunes_old_ones(tmp_path):
    cfg = _config(str(tmp_path), steps=5, save_interval=1, keep_last_n_checkpoints=2)
    run_on_ranks(2, _run, cfg)
    run = os.path.join(str(tmp_path), "run")
    assert sorted(d for d in os.listdir(run) if d.startswith("iter_")) == ["iter_0000004", "iter_0000005"]
    assert open(os.path.join(run, "latest")).read() == "iter_0000005"


# --- items 9 and 14: DeepSpeed's monitors, the log line ----------------------------------------------------

def _csv(path):
    with open(path) as f:
        rows = list(csv.reader(f))
    return {int(r[0]): float(r[1]) for r in rows[1:]}


def test_csv_monitor_gets_loss_lr_grad_norm_and_validation_loss_as_in_metrics_jsonl(tmp_path):
    cfg = _config(str(tmp_path), steps=4, eval_interval=2, log_interval=2)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}
    _, _, printed = run_on_ranks(2, _run, cfg, False, None, True)[0]
    metrics = _strict_lines(os.path.join(str(tmp_path), "run", "metrics.jsonl"))
    train = {m["consumed_samples"]: m for m in metrics if "loss" in m}
    files = os.path.join(str(tmp_path / "csv"), "job")
    assert _csv(os.path.join(files, "Train_Samples_train_loss.csv")) == {s: m["loss"] for s, m in train.items()}
    assert _csv(os.path.join(files, "Train_Samples_lr.csv")) == {s: m["lr"] for s, m in train.items()}
    norms = _csv(os.path.join(files, "Train_Samples_grad_norm.csv"))
    assert norms == {s: m["grad_norm"] for s, m in train.items() if m.get("grad_norm") is not None} and norms
    samples_per_step = min(train)
    val = _csv(os.path.join(files, "Validation_Samples_loss.csv"))
    assert val == {m["step"] * samples_per_step: m["val_loss"] for m in metrics if "val_loss" in m}
    assert sorted(val) == [0, 2 * samples_per_step, 4 * samples_per_step]
    assert _csv(os.path.join(files, "Train_Samples_tokens_per_second.csv"))
    # The printed line: tokens/s, peak memory and ETA on every log step (no loss scale in fp32).
    lines = [line for line in printed.splitlines() if line.startswith("step 4/4 |")]
    assert len(lines) == 1 and " tok/s | gnorm " in lines[0] and " | peak mem " in lines[0] and " | ETA 0s" in lines[0]


def test_fp16_log_line_shows_the_loss_scale(tmp_path):
    cfg = _config(str(tmp_path), steps=2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 10}
    _, _, printed = run_on_ranks(2, _run, cfg, False, None, True)[0]
    step_line = next(line for line in printed.splitlines() if line.startswith("step 1/"))
    assert "| scale 1024 |" in step_line, printed


def test_progress_survives_a_zero_width_terminal():
    """A terminal of 0 columns (a container's tty before it is sized) gets printed lines, not an empty bar."""
    import fcntl
    import pty
    import struct
    import termios
    from ds_megatron.training.monitoring import ProgressOutput
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    with os.fdopen(slave, "w") as stream:
        out = ProgressOutput(10, 0, stream=stream)
        assert out.bar is None
        out.step(3, "loss 1.0")
        out.close()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        wide = ProgressOutput(10, 0, stream=stream)
        assert wide.bar is not None
        wide.close()
    assert b"step 3/10 | loss 1.0" in os.read(master, 4096)


def test_resume_rewinds_metrics_to_the_checkpoint_and_keeps_the_lost_steps_aside(tmp_path):
    from ds_megatron.training.metrics import METRICS, rewind_metrics
    records = [{"step": s, "loss": 5.0 - s} for s in range(1, 7)] + [{"step": 4, "val_loss": 1.5}]
    path = tmp_path / METRICS
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert rewind_metrics(str(tmp_path), 4) == 2  # steps 5 and 6 were logged by the run lost after iter_4
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:4] + records[6:]
    assert [json.loads(line)["step"] for line in (tmp_path / f"{METRICS}.after-4").read_text().splitlines()] == [5, 6]
    assert rewind_metrics(str(tmp_path), 4) == 0 and rewind_metrics(str(tmp_path), 6) == 0  # nothing later: untouched
    path.write_text(json.dumps({"step": 5, "loss": 0.1}) + "\n")
    assert rewind_metrics(str(tmp_path), 4) == 1 and (tmp_path / f"{METRICS}.after-4.1").exists()  # never overwritten
