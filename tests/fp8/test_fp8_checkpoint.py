"""The delayed recipe's amax histories and scales are training state: ``ds-megatron train --resume`` with them is
bit-exact in both checkpoint formats, and a checkpoint meets a job of another recipe as ``checkpointing.fp8_scaling``
decides (ignored or started fresh, one logged line; another history length refused)."""
from __future__ import annotations

import logging
import zlib

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks
from ds_megatron.checkpointing.fp8_scaling import delayed_states, load_scaling_tensors, scaling_tensors
from ds_megatron.config import ConfigError
from ds_megatron.config.job import load_job
from ds_megatron.fp8 import delayed_scaling_groups, update_delayed_scaling
from ds_megatron.fp8.recipe import ROLES
from ds_megatron.models import GPTConfig, GPTModel
from ds_megatron.parallel.layout import ParallelLayout
from ds_megatron.parallel_state import ParallelState
from ds_megatron.tensor_parallel.layers import fp8_states
from ds_megatron.training.train import train

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 257,
         "hidden_dropout": 0.0, "attention_dropout": 0.0, "fp8": "e4m3", "fp8_recipe": "delayed",
         "fp8_amax_history_len": 3, "fp8_amax_compute_algo": "max"}


MOE = {"num_experts": 4, "moe_router_topk": 2}


def _config(out, ckpt_format, tp, steps=6, save_interval=100, ep=1, **model):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": 10 ** 6, "bf16": {"enabled": True},
            "megatron": {"tensor_model_parallel_size": tp, "expert_model_parallel_size": ep,
                         "model": {**MODEL, **(MOE if ep > 1 else {}), **model},
                         "train": {"train_iters": steps, "lr": 1e-2, "min_lr": 1e-3, "lr_warmup_iters": 1,
                                   "eval_interval": 100, "eval_iters": 1, "save_interval": save_interval,
                                   "output_dir": out, "ckpt_format": ckpt_format},
                         "data": {"default_corpus_bytes": 200_000, "split": "90,10"}}}


def _train(cfg, resume=False, stop_after=None):
    return train(load_job(cfg, dist.get_world_size()), cfg, resume=resume, stop_after=stop_after,
                 show_progress=False).losses


@pytest.mark.parametrize("ckpt_format,tp,ep", [("deepspeed", 1, 1), ("torch_dist", 2, 1), ("deepspeed", 1, 2),
                                               ("torch_dist", 1, 2)])
def test_resume_with_the_delayed_recipe_is_bit_exact(tmp_path, ckpt_format, tp, ep):
    """``ep`` 2: MoE layers whose 4 experts are split over the 2 ranks, each rank's experts' histories its own."""
    full = run_on_ranks(2, _train, _config(str(tmp_path / "full"), ckpt_format, tp, ep=ep))[0]
    cut = _config(str(tmp_path / "cut"), ckpt_format, tp, save_interval=3, ep=ep)
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
        held = [t for st in fp8_states(loading) for t in st.state_tensors()]  # held: no storage is reused
        storages = [t.untyped_storage().data_ptr() for t in held]
        load_scaling_tensors(loading, saved, "ckpt")
        fresh = _model()
        load_scaling_tensors(fresh, {}, "ckpt")  # started as a fresh run, one line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "ignored" in lines[0] and "fresh run" in lines[1], lines
    for got, want in zip(fp8_states(loading), fp8_states(saving)):
        assert all(torch.equal(got.amax_history[r], want.amax_history[r]) and torch.equal(got.scale[r], want.scale[r])
                   for r in want.scale)
    # loaded into the state's own tensors: a CUDA graph captured before the load reads those
    assert [t.untyped_storage().data_ptr() for st in fp8_states(loading) for t in st.state_tensors()] == storages
    assert all(float(s.scale["input"]) == 1.0 for s in fp8_states(fresh))
    with pytest.raises(ValueError, match="fp8_amax_history_len=3, this job has 4; resume with 3"):
        load_scaling_tensors(_model(fp8_amax_history_len=4), saved, "ckpt")  # a loop's own load, past the record


def _experts_saved_at_ep2_load_at_ep1():
    def build(ep, grouped):
        state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), ep=ep))
        torch.manual_seed(0)
        return GPTModel(GPTConfig(**{**MODEL, "num_layers": 1, **MOE, "moe_grouped_gemm": grouped}), state), state
    model, state = build(2, False)
    for name, st in delayed_states(model).items():  # numbers of its own per weight, the same wherever it is held
        for role in ROLES:
            st.step_amax[role].fill_(float(zlib.crc32(f"{name}{role}".encode()) % 1000 + 1))
    update_delayed_scaling(fp8_states(model), delayed_scaling_groups(state))
    mine = scaling_tensors(model)
    experts = {k.split(".")[5] for k in mine if ".experts." in k}
    assert experts == {str(2 * state.ep.rank), str(2 * state.ep.rank + 1)}, experts  # named by global index
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    saved = {k: v for d in everyone for k, v in d.items()}
    state.destroy()
    model, state = build(1, True)  # every rank all 4 experts, stacked (GroupedMLP)
    load_scaling_tensors(model, saved, "ckpt")
    got = scaling_tensors(model)
    state.destroy()
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in got)


def test_expert_histories_are_named_by_global_expert_and_load_at_another_ep():
    """What a checkpoint holds of the experts' histories (both formats: ``scaling_tensors``) is named by the global
    expert, so EP 2's ranks' (experts 0-1 and 2-3) load into an EP 1 job's experts, each its own (whichever
    experts class holds them)."""
    run_on_ranks(2, _experts_saved_at_ep2_load_at_ep1)
