"""The training job end to end on gloo ranks: TP/DP equivalence and exact resume."""
import json
import os

import pytest
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train


def _config(tmp, tp, mbs, steps=20, save_interval=0, dropout=0.0):
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 6,
        "megatron": {
            "tensor_model_parallel_size": tp,
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
                      "vocab_size": 257, "hidden_dropout": dropout, "attention_dropout": dropout},
            "train": {"train_iters": steps, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 4, "eval_interval": 10,
                      "eval_iters": 2, "save_interval": save_interval, "output_dir": os.path.join(tmp, "run")},
            "data": {"default_corpus_bytes": 1_000_000, "split": "80,20"},
        },
    }


def _train(cfg, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size())
    res = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False)
    return res.losses, res.val_losses


def test_tp2_dp2_matches_tp1_dp1_with_same_global_batch(tmp_path):
    # Global batch 8 x 2 accumulation steps either way: 4 ranks (dp=2, mbs=4) vs 1 rank (mbs=8).
    par = run_on_ranks(4, _train, _config(str(tmp_path / "a"), tp=2, mbs=4))
    ref = run_on_ranks(1, _train, _config(str(tmp_path / "b"), tp=1, mbs=8))
    losses, val = par[0]
    ref_losses, ref_val = ref[0]
    assert all(r == par[0] for r in par), "ranks disagree on the logged losses"
    assert sorted(losses) == list(range(1, 21))
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=2e-4, abs=2e-4), step
    for step in val:
        assert val[step] == pytest.approx(ref_val[step], rel=2e-4), step
    assert losses[20] < losses[1] - 1.0, "the loss did not fall"


def test_resume_continues_with_the_same_losses(tmp_path):
    # Dropout on: resuming must also restore the RNG streams (default and model-parallel).
    full = run_on_ranks(4, _train, _config(str(tmp_path / "full"), tp=2, mbs=2, steps=12, dropout=0.1))[0][0]
    cfg = _config(str(tmp_path / "cut"), tp=2, mbs=2, steps=12, save_interval=4, dropout=0.1)
    first = run_on_ranks(4, _train, cfg, False, 6)[0][0]  # saved at 4, and at 6 when stopping
    assert sorted(first) == list(range(1, 7))
    latest = open(os.path.join(str(tmp_path / "cut"), "run", "latest")).read()
    assert latest == "iter_0000006"
    second = run_on_ranks(4, _train, cfg, True)[0][0]
    assert sorted(second) == list(range(7, 13))
    for step in range(1, 7):
        assert first[step] == full[step]
    for step in range(7, 13):
        assert second[step] == full[step], step  # bit-exact: same data, RNG streams, optimizer state
    metrics = [json.loads(line) for line in open(os.path.join(str(tmp_path / "cut"), "run", "metrics.jsonl"))]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 13))


def _step0_validation(cfg):
    return _train(cfg, stop_after=1)[1][0]


@pytest.mark.parametrize("world,layout,mbs,gas", [(2, {"data": 2}, 4, 1), (2, {"tensor_model_parallel_size": 2}, 1, 8)],
                         ids=["dp2-mbs4", "tp2-mbs1"])
def test_validation_reads_the_same_samples_at_every_layout(tmp_path, world, layout, mbs, gas):
    """eval_iters counts global batches (Megatron's): the same weights and data give the same step-0 validation
    loss whatever the micro-batch, accumulation and layout (float32 summation orders only)."""
    def cfg(out, tp_pp, mbs, gas):
        c = _config(out, tp=1, mbs=mbs, steps=2)
        c["gradient_accumulation_steps"] = gas
        c["megatron"].update({k: v for k, v in tp_pp.items() if k != "data"})
        c["megatron"]["train"]["eval_interval"] = 1
        return c
    reference = run_on_ranks(1, _step0_validation, cfg(str(tmp_path / "one"), {}, 2, 4))[0]
    got = run_on_ranks(world, _step0_validation, cfg(str(tmp_path / "other"), layout, mbs, gas))[-1]
    assert got == pytest.approx(reference, rel=1e-6), (got, reference)


def _printed(cfg, resume=False):
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(load_job(cfg, dist.get_world_size()), cfg, resume=resume, show_progress=True)
    return out.getvalue().splitlines()


def test_a_run_says_what_it_is_and_when_it_saves(tmp_path):
    cfg = _config(str(tmp_path), tp=1, mbs=2, steps=2, save_interval=1)
    first = run_on_ranks(1, _printed, cfg)[0]
    # The config's warmup (4) outlasts this 2-step run: said once, before the run's own lines.
    assert first[0].startswith("note: megatron.train.lr_warmup_iters=4 is longer than the run")
    assert first[1] == ("layout: 1 ranks, TP 1 x CP 1 x PP 1 x DP 1; global batch 4 = micro-batch 2 x 2 "
                        "accumulation x DP 1, of 32 tokens")
    assert first[2].startswith("data: train ") and "documents 0.." in first[2] and "; validation " in first[2]
    out = os.path.join(str(tmp_path), "run")
    assert [line for line in first if line.startswith("saved")] == [
        f"saved {out}/iter_0000001 (step 1)", f"saved {out}/iter_0000002 (step 2)"]
    cfg["megatron"]["train"]["train_iters"] = 3
    resumed = run_on_ranks(1, _printed, cfg, True)[0]
    assert f"resumed from {out}/iter_0000002: step 2, 8 samples consumed" in resumed


def test_bad_job_config_names_the_field(tmp_path):
    cfg = _config(str(tmp_path), tp=2, mbs=2)
    cfg["megatron"]["model"]["num_attention_heads"] = 3
    with pytest.raises(ConfigError, match="model.hidden_size=32 is not divisible by model.num_attention_heads=3"):
        load_job(cfg, 4)
    cfg = _config(str(tmp_path), tp=2, mbs=2)
    cfg["megatron"]["train"]["lr_decay_style"] = "cosine-ish"
    with pytest.raises(ConfigError, match="megatron.train.lr_decay_style"):
        load_job(cfg, 4)
    cfg = _config(str(tmp_path), tp=2, mbs=2)
    cfg["megatron"]["data"]["data_path"] = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match=r"megatron.data.data_path=.*nothing.* has no .*\.bin / \.idx; make them "
                                          r"with `ds-megatron preprocess"):
        load_job(cfg, 4)
    del cfg["megatron"]["data"]["data_path"]
    cfg["megatron"]["data"]["tokenizer"] = "gpt2"
    with pytest.raises(ConfigError, match="megatron.data.tokenizer='gpt2' does not exist; give \"byte\""):
        load_job(cfg, 4)
    del cfg["megatron"]["data"]["tokenizer"]
    with pytest.raises(ConfigError, match="megatron.model.sequence_parallel is set at megatron.sequence_parallel"):
        cfg["megatron"]["model"]["sequence_parallel"] = True
        load_job(cfg, 4)


def test_bad_config_fails_with_one_line_before_torch_is_imported(tmp_path):
    """The CLI refuses a bad config with one line, exit code 2, and without importing torch or
    DeepSpeed (which is what keeps it fast: ~0.15 s here; speed itself is not asserted)."""
    import subprocess
    import sys
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                               "megatron": {"tensor_model_parallel_size": 3}}))
    proc = subprocess.run([sys.executable, "-m", "ds_megatron.cli", "train", "--config", str(bad)],
                          capture_output=True, text=True, env={**os.environ, "WORLD_SIZE": "4"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ds-megatron train: error: megatron: world size 4 is not divisible by tp*cp*pp = 3*1*1 = 3; "
        "change the sizes or the number of ranks"]
    assert "Traceback" not in proc.stdout + proc.stderr
    probe = ("import sys; from ds_megatron.training.job import main; "
             f"rc = main(['--config', {str(bad)!r}]); print(rc, 'torch' in sys.modules, 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "WORLD_SIZE": "4"}, timeout=60).stdout.split()
    assert out == ["2", "False", "False"]


def test_preprocessed_jsonl_trains_through_the_job(tmp_path):
    import sysconfig
    from ds_megatron.data.preprocess import main as preprocess_main
    # A small JSONL corpus of real text: a few stdlib modules, one document each.
    stdlib = sysconfig.get_paths()["stdlib"]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for name in ("argparse.py", "json/decoder.py", "textwrap.py", "string.py", "shlex.py"):
            with open(os.path.join(stdlib, name), encoding="utf-8") as src:
                f.write(json.dumps({"text": src.read()}) + "\n")
    assert preprocess_main(["--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", str(tmp_path / "c")]) == 0
    cfg = _config(str(tmp_path), tp=2, mbs=2, steps=4)
    cfg["megatron"]["data"] = {"data_path": str(tmp_path / "c"), "split": "80,20"}
    losses, val = run_on_ranks(4, _train, cfg)[0]
    assert sorted(losses) == [1, 2, 3, 4] and 0 in val and 4 in val


def _train_with_batches_on_another_device(cfg):
    """The job's loop with every loader batch on a device the engine is not on (torch's "lazy" device).

    On a GPU the loader's batches are on the CPU and the model on cuda:0; on this CPU-only
    machine the lazy device (which computes on the CPU) stands in for "not the engine's device".
    The loop must move each batch to ``engine.device`` itself, in training and in evaluation.
    """
    import torch._lazy
    import torch._lazy.ts_backend
    import ds_megatron.training.build as build
    torch._lazy.ts_backend.init()
    real = build.build_data_loader
    lazy_batches = []

    class OnLazyDevice:
        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            for batch in self.loader:
                lazy_batches.append(1)
                yield {k: v.to("lazy") for k, v in batch.items()}

    build.build_data_loader = lambda *a, **k: OnLazyDevice(real(*a, **k))
    try:
        return _train(cfg), len(lazy_batches)
    finally:
        build.build_data_loader = real


def test_batches_are_moved_to_the_engine_device(tmp_path):
    pytest.importorskip("torch._lazy.ts_backend")
    cfg = _config(str(tmp_path / "lazy"), tp=2, mbs=2, steps=3)
    cfg["megatron"]["train"]["eval_interval"] = 3
    (losses, val), lazy_batches = run_on_ranks(2, _train_with_batches_on_another_device, cfg)[0]
    ref_losses, ref_val = run_on_ranks(2, _train, _config(str(tmp_path / "ref"), tp=2, mbs=2, steps=3))[0]
    # 3 steps x 2 micro-batches, and 2 evaluations of eval_iters 2 global batches (2 x 2 micro-batches each):
    # every batch came from the lazy loader.
    assert lazy_batches == 3 * 2 + 2 * 2 * 2
    assert losses == ref_losses and val == ref_val


def _count_loss_reads(cfg):
    from ds_megatron.training.monitoring import PendingSteps
    real = PendingSteps.flush
    flushed = []

    def flush(self):
        rows = real(self)
        flushed.append([step for step, _, _ in rows])
        return rows
    PendingSteps.flush = flush
    try:
        return {"losses": _train(cfg)[0], "flushed": [f for f in flushed if f]}
    finally:
        PendingSteps.flush = real


def test_losses_reach_the_host_once_per_log_interval(tmp_path):
    """With log_interval 3 the per-step losses stay on the device and are read in one go every 3 steps,
    yet every step's loss is recorded (metrics.jsonl too) and equals the log-every-step run."""
    every = _config(str(tmp_path / "every"), tp=2, mbs=2, steps=6)
    every["megatron"]["train"].update(log_interval=1, eval_interval=100)
    grouped = _config(str(tmp_path / "grouped"), tp=2, mbs=2, steps=6)
    grouped["megatron"]["train"].update(log_interval=3, eval_interval=100)
    ref = run_on_ranks(2, _train, every)[0][0]
    losses = run_on_ranks(2, _count_loss_reads, grouped)[0]
    assert losses["losses"] == ref
    assert losses["flushed"] == [[1], [2, 3], [4, 5, 6]], losses  # the first step is logged too
    metrics = [json.loads(line) for line in open(os.path.join(str(tmp_path / "grouped"), "run", "metrics.jsonl"))]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 7))
    assert [m["step"] for m in metrics if "tokens_per_s" in m] == [1, 3, 6]
