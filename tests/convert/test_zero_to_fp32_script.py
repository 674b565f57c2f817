"""DeepSpeed's ``zero_to_fp32.py`` beside the job's ZeRO checkpoints (``optimizer_impl: "deepspeed"``).

With data parallelism alone DeepSpeed's script must give exactly the weights of
``ds-megatron export-fp32`` (the independent reference: it reads the model files,
not the ZeRO partitions).  With TP=2 DeepSpeed's script fails (it expects one
optimizer file per data-parallel rank); the job replaces it and ``zero_to_torch.py``
by a script that exits non-zero with one line naming ``ds-megatron export-fp32``,
which consolidates that checkpoint.
"""
import glob
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from harness import run_on_ranks
from ds_megatron.cli import main as cli_main
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(out, stage, tp):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage},
            "megatron": {"optimizer_impl": "deepspeed", "tensor_model_parallel_size": tp,
                         "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                                   "vocab_size": 257},
                         "train": {"train_iters": 2, "eval_interval": 2, "eval_iters": 1, "output_dir": out},
                         "data": {"default_corpus_bytes": 200_000, "split": "80,20"}}}


def _train(cfg):
    return train(load_job(cfg, dist.get_world_size()), cfg, show_progress=False).losses


def _script(out, name, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(out, name), *args], cwd=out, capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("stage", [1, 2])
def test_data_parallel_zero_script_equals_export_fp32(tmp_path, stage):
    out = str(tmp_path / "run")
    run_on_ranks(2, _train, _config(out, stage, tp=1))
    done = _script(out, "zero_to_fp32.py", ".", str(tmp_path / "ds"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert cli_main(["export-fp32", out, str(tmp_path / "ours.safetensors")]) == 0
    ours = load_file(str(tmp_path / "ours.safetensors"))
    (path,) = glob.glob(str(tmp_path / "ds" / "*.bin"))
    theirs = torch.load(path, weights_only=False)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k].float()) for k in ours)


def test_model_parallel_zero_scripts_name_export_fp32(tmp_path):
    out = str(tmp_path / "run")
    run_on_ranks(4, _train, _config(out, 1, tp=2))  # TP=2 x DP=2, ZeRO-1 over DP
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        done = _script(out, name, ".", str(tmp_path / name))
        assert done.returncode == 1 and not os.path.exists(tmp_path / name)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name}: this checkpoint holds a ds_megatron model split at "
                                                       "TP=2 x PP=1 x EP=1"), done.stderr
        assert "ds-megatron export-fp32 CHECKPOINT_DIR model.safetensors" in lines[0]
    assert cli_main(["export-fp32", out, str(tmp_path / "ours.safetensors")]) == 0
    assert sum(t.numel() for t in load_file(str(tmp_path / "ours.safetensors")).values()) > 0
