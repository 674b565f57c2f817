"""The delayed recipe's amax histories and scales are training state: ``ds-megatron train --resume`` with them is
bit-exact in both checkpoint formats, and a checkpoint meets a job of another recipe as ``checkpointing.fp8_scaling``
decides (ignored or started fresh, one logged line; another history length refused)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.checkpointing.fp8_scaling import load_scaling_tensors, scaling_tensors
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.fp8 import update_delayed_scaling
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.tensor_parallel.layers import fp8_states
from ds_megatron.training.train import train

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 257,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "fp8": "e4m3", "fp8_recipe": "delayed",
         "fp8_amax_history_len": 3, "fp8_amax_compute_algo": "max"}


def _config(out, ckpt_format, tp, steps=6, save_interval=100, **model):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": 10 ** 6, "bf16": {"enabled": True},
            "megatron": {"tensor_model_parallel_size": tp, "model": {**MODEL, **model},
                         "train": {"train_iters": steps, "lr": 1e-2, "min_lr": 1e-3, "lr_warmup_iters": 1,
                                   "eval_interval": 100, "eval_iters": 1, "save_interval": save_interval,
                                   "output_dir": out, "ckpt_format": ckpt_format},
                         "data": {"default_corpus_bytes": 200_000, "split": "90,10"}}}


def _train(cfg, resume=False, stop_after=None):
    return train(load_job(cfg, dist.get_world_size()), cfg, resume=resume, stop_after=stop_after,
                 show_progress=False).losses


@pytest.mark.parametrize("ckpt_format,tp", [("deepspeed", 1), ("torch_dist", 2)])
def test_resume_with_the_delayed_recipe_is_bit_exact(tmp_path, ckpt_format, tp):
    full = run_on_ranks(2, _train, _config(str(tmp_path / "full"), ckpt_format, tp))[0]
    cut = _config(str(tmp_path / "cut"), ckpt_format, tp, save_interval=3)
    first = run_on_ranks(2, _train, cut, False, 3)[0]
    second = run_on_ranks(2, _train, cut, True)[0]
    assert sorted(second) == [4, 5, 6]
    assert [first[s] for s in (1, 2, 3)] == [full[s] for s in (1, 2, 3)]
    assert [second[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # exactly


def test_another_history_length_is_refused_before_anything_starts(tmp_path):
    from ds_megatron.checkpointing.run_dir import check_resume
    out = str(tmp_path / "run")
    run_on_ranks(2, _train, _config(out, "deepspeed", 1, steps=1, save_interval=1))
    job = load_job(_config(out, "deepspeed", 1, fp8_amax_history_len=4), 2)
    with pytest.raises(ConfigError) as err:
        check_resume(job, out)
    assert "fp8_amax_history_len=4" in str(err.value) and "resume with 3" in str(err.value)
    for other in ({"fp8_recipe": "tensorwise"}, {"fp8": None}):  # histories ignored there: accepted
        assert check_resume(load_job(_config(out, "deepspeed", 1, **other), 2), out) == "iter_0000001"


def _model(**extra) -> GPTModel:
    return GPTModel(GPTConfig(**{**MODEL, "num_layers": 1, **extra}))


def test_histories_meet_a_job_of_another_recipe_as_decided(caplog):
    saving = _model()
    for s in fp8_states(saving):
        for role, t in s.step_amax.items():
            t.fill_(2.0 if role == "input" else 3.0)
    update_delayed_scaling(fp8_states(saving), {"dense": []})
    saved = scaling_tensors(saving)
    assert len(saved) == 2 * 4 and all(k.startswith("fp8.layers.0.") for k in saved)
    assert not any("fp8" in k or "amax" in k for k in saving.state_dict())  # never model weights (HF export too)
    with caplog.at_level(logging.WARNING, logger="ds_megatron"):
        load_scaling_tensors(_model(fp8_recipe="tensorwise"), saved, "ckpt")  # ignored, one line
        loading = _model()
        load_scaling_tensors(loading, saved, "ckpt")
        fresh = _model()
        load_scaling_tensors(fresh, {}, "ckpt")  # started as a fresh run, one line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "ignored" in lines[0] and "fresh run" in lines[1], lines
    for got, want in zip(fp8_states(loading), fp8_states(saving)):
        assert all(torch.equal(got.amax_history[r], want.amax_history[r]) and torch.equal(got.scale[r], want.scale[r])
                   for r in want.scale)
    assert all(float(s.scale["input"]) == 1.0 for s in fp8_states(fresh))
    with pytest.raises(ValueError, match="fp8_amax_history_len=3, this job has 4; resume with 3"):
        load_scaling_tensors(_model(fp8_amax_history_len=4), saved, "ckpt")  # a loop's own load, past the record
