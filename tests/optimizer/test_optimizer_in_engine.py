"""Megatron's optimizer path inside DeepSpeed's loop on 4 gloo ranks (TP=2 x DP=2)."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_on_ranks

import ds_megatron
from ds_megatron.models.gpt import GPTModel
from ds_megatron.config import GPTConfig
from ds_megatron.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from ds_megatron.tensor_parallel import RNGStatesTracker, allreduce_tp_partial_grads, model_parallel_seed
from ds_megatron.config.job import load_job
from ds_megatron.training.train import train

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "vocab_size": 257,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}


def _job_config(tmp, precision, steps, save_interval=0):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 6,
           "megatron": {"tensor_model_parallel_size": 2, "model": MODEL,
                        "train": {"train_iters": steps, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 4,
                                  "eval_interval": 1000, "eval_iters": 1, "save_interval": save_interval,
                                  "output_dir": os.path.join(tmp, "run")},
                        "data": {"default_corpus_bytes": 1_000_000, "split": "90,10"}}}
    cfg.update(precision)
    return cfg


def _train(cfg, resume=False, stop_after=None):
    job = load_job(cfg, dist.get_world_size())
    res = train(job, cfg, resume=resume, stop_after=stop_after, show_progress=False)
    return res.losses


def _metrics(cfg):
    path = os.path.join(cfg["megatron"]["train"]["output_dir"], "metrics.jsonl")
    return [json.loads(line) for line in open(path) if '"loss"' in line]


def test_fp16_and_bf16_track_fp32_over_50_steps(tmp_path):
    runs = {}
    # A scale that never overflows here, so the fp16 run skips no step and stays in lockstep with fp32
    # (skips are tested below); DeepSpeed's default 2**16 overflows twice at the start of this model.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 12}}
    for name, precision in (("fp32", {}), ("fp16", fp16), ("bf16", {"bf16": {"enabled": True}})):
        cfg = _job_config(str(tmp_path / name), precision, steps=50)
        losses = run_on_ranks(4, _train, cfg)
        assert all(r == losses[0] for r in losses), f"{name}: ranks disagree"
        runs[name] = (losses[0], _metrics(cfg))
    ref, ref_metrics = runs["fp32"]
    assert ref[50] < ref[1] - 1.0, "the fp32 run did not learn"
    for name, tol in (("fp16", 0.01), ("bf16", 0.02)):
        losses, metrics = runs[name]
        worst = max(abs(losses[s] - ref[s]) for s in ref)
        assert worst < tol, f"{name} drifts from fp32 by {worst:.4f}"
        # The reported norm is of the unscaled grads (a missing unscale shows up here, Adam would hide it).
        ratios = [m["grad_norm"] / r["grad_norm"] for m, r in zip(metrics, ref_metrics)]
        assert all(0.75 < x < 1.25 for x in ratios) and abs(sum(ratios) / len(ratios) - 1) < 0.03, (name, ratios)
    assert {m["loss_scale"] for m in runs["fp16"][1]} == {4096.0} and runs["fp16"][1][-1]["skipped_steps"] == 0
    assert runs["bf16"][1][0]["loss_scale"] is None and runs["fp32"][1][0]["skipped_steps"] == 0


def test_resume_is_bit_exact_with_the_loss_scaler(tmp_path):
    # A scale that overflows at first and grows back every 3 clean steps, so its state matters at the cut.
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 3, "hysteresis": 1}}
    full_cfg = _job_config(str(tmp_path / "full"), fp16, steps=12)
    full = run_on_ranks(4, _train, full_cfg)[0]
    cfg = _job_config(str(tmp_path / "cut"), fp16, steps=12, save_interval=6)
    first = run_on_ranks(4, _train, cfg, False, 6)[0]
    second = run_on_ranks(4, _train, cfg, True)[0]
    assert sorted(second) == list(range(7, 13))
    assert {**first, **second} == full  # bit-exact: params, fp32 main params, Adam state and scaler
    scales = [m["loss_scale"] for m in _metrics(full_cfg)]
    assert [m["loss_scale"] for m in _metrics(cfg)] == scales
    assert _metrics(full_cfg)[-1]["skipped_steps"] > 0 and len(set(scales[6:])) > 1, scales


def _snapshot(engine, model):
    opt = engine.optimizer
    return ([p.detach().clone() for p in model.parameters()],
            [p.main_param.clone() for p in model.parameters()],
            {k: {n: t.clone() for n, t in v.items()} for k, v in opt.optimizer.state_dict()["state"].items()})


def _same(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and a[2].keys() == b[2].keys()
            and all(torch.equal(a[2][k][n], b[2][k][n]) for k in a[2] for n in a[2][k]))


def _inject_inf_on_one_rank():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
           "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 100}},
           "megatron": {"tensor_model_parallel_size": 2}}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    tracker = model_parallel_seed(0, state.tp.rank, tracker=RNGStatesTracker())
    model = GPTModel(GPTConfig(**MODEL), state, rng_tracker=tracker)
    engine, opt, _, _ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and model.word_embeddings.weight.dtype == torch.float16
    g = torch.Generator().manual_seed(100 + state.dp.rank)
    log = []
    for step in range(6):
        tokens = torch.randint(0, 257, (2, 33), generator=g)
        loss = engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        assert loss.dtype == torch.float32
        handle = None
        if step in (2, 3) and dist.get_rank() == 3:
            # A replicated (not TP-split) param on TP rank 1: its norm contribution is skipped there,
            # and its grad reaches rank 1 only through the DP all-reduce; ranks 0 and 2 learn of it
            # only from the found_inf all-reduce.
            handle = model.final_layernorm.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        engine.backward(loss)
        if handle is not None:
            handle.remove()
        before, sched_step = _snapshot(engine, model), engine.lr_scheduler.last_batch_iteration
        engine.step()
        after = _snapshot(engine, model)
        log.append({"step": step, "overflow": opt.overflow, "unchanged": _same(before, after),
                    "lr_kept": engine.lr_scheduler.last_batch_iteration == sched_step, "scale": opt.cur_scale,
                    "norm": engine.get_global_grad_norm(), "skipped": engine.skipped_steps,
                    "loss_finite": bool(torch.isfinite(loss))})
    state.destroy()
    return log


def test_inf_on_one_rank_skips_the_step_on_every_rank():
    logs = run_on_ranks(4, _inject_inf_on_one_rank)
    for rank, log in enumerate(logs):
        assert [e["overflow"] for e in log] == [False, False, True, True, False, False], rank
        assert [e["unchanged"] for e in log] == [False, False, True, True, False, False], rank
        assert [e["lr_kept"] for e in log] == [False, False, True, True, False, False], rank
        # hysteresis 2: the first overflow spends it, the second halves the scale.
        assert [e["scale"] for e in log] == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0], rank
        assert [e["norm"] is None for e in log] == [False, False, True, True, False, False], rank
        assert log[-1]["skipped"] == 2 and all(e["loss_finite"] for e in log)
    assert [[e["norm"] for e in log] for log in logs[1:]] == [[e["norm"] for e in logs[0]]] * 3


def _clipped_norm_vs_single_rank(sequence_parallel):
    state = ds_megatron.initialize_model_parallel({"megatron": {"tensor_model_parallel_size": 2}})
    cfg = GPTConfig(**MODEL, sequence_parallel=sequence_parallel)
    torch.manual_seed(3)
    tp_model = GPTModel(cfg, state, rng_tracker=model_parallel_seed(3, state.tp.rank, tracker=RNGStatesTracker()))
    torch.manual_seed(3)
    single = GPTModel(cfg).double()  # the reference in float64 (the float32 init, widened exactly)
    tokens = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(5))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    tp_model(batch).backward()
    allreduce_tp_partial_grads(tp_model, state.tp)  # the model-parallel half of the step's gradient sync
    single(batch).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(single.parameters(), 1e-3))
    opt = FP32Optimizer(torch.optim.SGD(tp_model.parameters(), lr=0.0), clip_grad=1e-3, parallel_state=state)
    ok, norm, _ = opt.step()
    after = opt.get_grad_norm()
    state.destroy()
    return ok, norm, ref_norm, after


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_clipped_global_norm_with_tp2_and_tied_embeddings_equals_single_rank(sequence_parallel):
    for ok, norm, ref_norm, after in run_on_ranks(4, _clipped_norm_vs_single_rank, sequence_parallel):
        # The float32 norm of float32 gradients: ~1e-7 relative from float64 whatever the summation order; a norm
        # that counts TP duplicates or the tied embedding twice is off by percents.
        assert ok and norm == pytest.approx(ref_norm, rel=1e-5)
        assert after == pytest.approx(1e-3, rel=1e-4)  # the clipped grads have exactly the target norm
