"""The one-rank training job of ``ds-megatron train`` redone in float64: the reference of the layout tests.

``train(job, ...)`` trains fp32 / bf16 / fp16 params only (``FP32Optimizer`` wraps float32 params), so the
layout-equivalence tests cannot run the job itself in float64.  ``train_float64(cfg)`` repeats, on one rank
and without the engine, what the job does there, with the same pieces: ``build_model`` (the job's seed, so the
same initial weights, cast exactly to float64; an expert bias stays fp32 and moves once per step as the job's
``finalize_model_grads`` moves it), the same datasets (``build_datasets``) and loader,
``get_param_groups`` + ``torch.optim.AdamW`` with the job's hyper-parameters, ``build_lr_scheduler``, gradient
accumulation (each micro-batch's loss / gas), Megatron's clipping by the global norm (``max_norm / (norm + 1e-6)``
when below 1) and the validation mean.

``assert_within_float32_noise``: how far a float32 run may be from that reference.  Float32 rounding depends on
the summation order, which depends on the layout and on the CPU (AVX2 or AVX-512 kernels).  Adam divides each
gradient by its own running RMS, so an element whose gradient nearly cancels gets a step of another size from a
rounding difference: two correct float32 runs end up to ~1.3e-5 apart on single elements, no fixed tolerance
near 1e-5 holds on every CPU.  That sensitivity belongs to the element, and every float32 run of the job shows
it, so the noise is measured rather than guessed: ``noise`` (per weight tensor, and for the losses) is the
largest max-distance from float64 of two float32 runs of the one-rank model that sum in different orders (the
job itself, and ``train_float64(cfg, torch.float32, split=2)``).  A run passes when its own max-distance is at
most ``FACTOR * noise + steps * EPS32 * max |value|``:

* ``FACTOR`` = 8: two roundings of the same computation differ in size by a random factor.  Over the 13 layouts of
  ``test_train_context_parallel.py`` / ``test_train_kv_replicas.py``, with torch's AVX2 kernels and with its
  scalar ones (``ATEN_CPU_CAPABILITY=default``, other summation orders), the largest distance was 0.42 of the
  bound (3.4 x noise); the noise itself was at most 1.1e-5.
* the floor: each of the ``steps`` updates rounds a weight to float32 (eps/2 of its size), in the run and in
  the noise sample; it matters only for tensors whose noise is that last rounding (norm weights near 1).
* a layout error is far outside: with the KV copies' or the sequence-parallel gradients left unsummed, or the
  gradients not reduced over CP, weights end 1e-2 away and the losses 5e-4 to 6e-3 away, 1e3 to 1e5 times the bound.

``NOISE_CAP`` = 1e-4 checks the reference itself: a float32 one-rank run further than that from it means this
loop no longer does what the job does (a loop without the clipping, with one more warmup step, or with min_lr
2e-4 instead of 3e-4 is 7e-3 to 7e-2 away from the job), and that would also inflate the bound.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from ds_megatron.config.job import load_job
from ds_megatron.data.sampler import build_data_loader
from ds_megatron.moe import expert_bias_routers, update_expert_bias
from ds_megatron.optimizer import get_param_groups
from ds_megatron.parallel_state import ParallelState
from ds_megatron.training.build import build_datasets, build_model
from ds_megatron.training.lr_schedule import build_lr_scheduler

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
FACTOR = 8  # see the module docstring
NOISE_CAP = 1e-4


def train_float64(cfg, dtype=torch.float64,
                  split=1) -> Tuple[Dict[int, float], Dict[int, float], Dict[str, torch.Tensor]]:
    """(losses by step, validation losses by step, final weights by ``GPTModel`` name) of the one-rank job of
    ``cfg`` (no PP / TP / CP: its micro-batch is the whole global micro-batch), computed in ``dtype``.

    ``split``: each micro-batch cut into ``split`` smaller ones (``split`` times the accumulation steps): the
    same arithmetic summed in another order (the job's loss mask is all ones, so the mean of the halves' means
    is the mean).  In float32 that is a second sample of the job's float32 rounding noise.
    """
    job = load_job(cfg, 1)
    tcfg, model_cfg = job.train, job.model
    # The z-loss and the sequence-wise balancing loss are means over tokens / sequences, which the split keeps;
    # the micro-batch-wide balancing losses are not.
    assert not (model_cfg.num_experts and model_cfg.moe_aux_loss_coeff and split > 1
                and model_cfg.moe_router_load_balancing_type in ("aux_loss", "global_aux_loss")), \
        "a micro-batch-wide balancing loss changes when the micro-batch is split"
    assert "optimizer" not in job.ds_config and "scheduler" not in job.ds_config
    assert job.megatron.precision.params_dtype == "fp32" and not job.train.load_hf
    mbs = job.ds_config["train_micro_batch_size_per_gpu"]
    gas = job.ds_config.get("gradient_accumulation_steps", 1)
    clip = job.ds_config.get("gradient_clipping", 0.0)
    assert mbs % split == 0, (mbs, split)
    model, _ = build_model(job, ParallelState.single())  # the job's seed: the job's initial weights
    model.to(dtype)
    optimizer = torch.optim.AdamW(get_param_groups(model), lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2),
                                  eps=tcfg.adam_eps, weight_decay=tcfg.weight_decay)
    scheduler = build_lr_scheduler(optimizer, tcfg.lr, tcfg.min_lr, tcfg.lr_warmup_iters,
                                   tcfg.lr_decay_iters or tcfg.train_iters, tcfg.lr_decay_style)
    # The job's datasets (one rank: the global batch is mbs x gas, and eval_iters counts global batches).
    train_ds, valid_ds = build_datasets(job, mbs * gas, mbs * gas)
    batches = iter(build_data_loader(train_ds, mbs // split, 0, 1, 0, job.data.num_workers,
                                     job.data.dataloader_type, tcfg.seed))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            values = [float(model(batch)) for batch in build_data_loader(valid_ds, mbs, 0, 1, 0)]
        model.train()
        return sum(values) / max(len(values), 1)

    losses, val = {}, {}
    if valid_ds is not None:
        val[0] = evaluate()
    for step in range(tcfg.train_iters):
        total = 0.0
        for _ in range(gas * split):
            batch = next(batches)
            assert bool((batch["loss_mask"] == 1).all()), "a masked token: the halves' means would not average"
            loss = model(batch)
            (loss / (gas * split)).backward()
            total += float(loss.detach()) / (gas * split)
        losses[step + 1] = total
        update_expert_bias(expert_bias_routers([model]))  # the job's finalize_model_grads does it here
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        if clip > 0 and clip / (norm + 1e-6) < 1.0:  # Megatron's clip_coefficient
            for g in grads:
                g.mul_(clip / (norm + 1e-6))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if valid_ds is not None and ((step + 1) % tcfg.eval_interval == 0 or step + 1 == tcfg.train_iters):
            val[step + 1] = evaluate()
    weights = {name: t.detach().clone() for name, t in model.state_dict().items() if t.is_floating_point()}
    return losses, val, weights


def _max_dev(got: Dict, want: Dict) -> float:
    return max((abs(got[k] - want[k]) for k in want), default=0.0)


def assert_within_float32_noise(run, fp32_runs, reference, steps: int) -> None:
    """``run``: (losses, val_losses, weights) of the layout under test, float32; ``fp32_runs``: the same of
    float32 runs of the one-rank model (the noise samples); ``reference``: the same of the float64 one.

    For the losses, the validation losses and each weight tensor T:
    ``max |run - float64| <= FACTOR * noise + STEPS * EPS32 * max |float64|``, where noise is the largest
    ``max |fp32 run - float64|`` over ``fp32_runs``.  The floor: each of the ``steps`` updates rounds a weight
    (and each logged loss is rounded) to float32, eps/2 of its size, twice over (run and noise sample).
    """
    losses64, val64, weights64 = reference
    for fp32 in fp32_runs:
        worst = max(_max_dev(fp32[0], losses64), _max_dev(fp32[1], val64),
                    *((fp32[2][n].double() - w).abs().max().item() for n, w in weights64.items()))
        assert worst <= NOISE_CAP, f"a float32 one-rank run is {worst:.2e} from the float64 reference: " \
                                   "float64_reference.train_float64 no longer does what the job does"
    for what, i in (("loss", 0), ("validation loss", 1)):
        assert sorted(run[i]) == sorted(reference[i]), what
        noise = max(_max_dev(fp32[i], reference[i]) for fp32 in fp32_runs)
        for step, want in reference[i].items():
            bound = FACTOR * noise + steps * EPS32 * abs(want)
            assert abs(run[i][step] - want) <= bound, \
                f"{what} at step {step}: {run[i][step]!r} is {abs(run[i][step] - want):.2e} from float64 " \
                f"{want!r}; float32 noise {noise:.2e}, bound {bound:.2e}"
    assert weights64 and sorted(run[2]) == sorted(weights64)
    for name, want in weights64.items():
        got = run[2][name]
        assert got.shape == want.shape, name
        dev = (got.double() - want).abs().max().item()
        noise = max((fp32[2][name].double() - want).abs().max().item() for fp32 in fp32_runs)
        bound = FACTOR * noise + steps * EPS32 * want.abs().max().item()
        assert dev <= bound, f"{name}: {dev:.2e} from float64; float32 noise {noise:.2e}, bound {bound:.2e}"
