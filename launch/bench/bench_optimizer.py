"""Per-step optimizer overhead: our Megatron wrappers next to DeepSpeed's own path of the same precision.

    python launch/bench/bench_optimizer.py [--params-millions 8] [--rounds 15] [--clip 0.001] [--threads 1]

One process (world size 1), one model (a stack of Linear(1024) + LayerNorm),
the same torch AdamW (unfused, as a user passes it) inside every variant.
Each round runs a real forward and backward through each engine, then times
``engine.step()``; the inner ``AdamW.step()`` is timed inside it through the
optimizer's step hooks.  The overhead of a wrapper is step minus inner step:
the gradient sync's end, unscale and inf/nan check, global norm, clipping,
main-param copies and bookkeeping.  Subtracting the inner step measured in
the same step, and running the variants round-robin (round r of every
variant before round r+1 of any), keeps the figures comparable on a busy box.

Pairs (ours / DeepSpeed's path of the same precision):

* fp32: ``FP32Optimizer`` / DeepSpeed's client optimizer with its fp32 clipping;
* bf16: ``Float16OptimizerWithFloat16Params`` / DeepSpeed's bf16 optimizer;
* fp16: ``Float16OptimizerWithFloat16Params`` with the dynamic scaler / DeepSpeed's fp16
  optimizer with its dynamic scaler (DeepSpeed refuses fp16 on a CPU; the benchmark lets it
  through by answering its accelerator's ``is_fp16_supported`` with True);
* distributed optimizer (bf16): ``DistributedOptimizer`` / DeepSpeed ZeRO stage 1 (bf16).

``--clip`` is small enough that every variant clips (each pays the clipping pass).
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_megatron.integration.local_job import local_rank_env  # noqa: E402
from ds_megatron.utils.dist_env import free_port  # noqa: E402

PAIRS = [  # (precision, our variant, DeepSpeed's variant)
    ("fp32", "ours fp32 (FP32Optimizer)", "deepspeed fp32 (client AdamW + its clipping)"),
    ("bf16", "ours bf16 (Float16Optimizer)", "deepspeed bf16 (BF16_Optimizer)"),
    ("fp16", "ours fp16 (Float16Optimizer, dynamic scale)", "deepspeed fp16 (FP16_UnfusedOptimizer)"),
    ("bf16 sharded", "ours bf16 (DistributedOptimizer)", "deepspeed bf16 ZeRO-1"),
]


def _model(width, depth):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers)


class _InnerTimer:
    """Times the torch optimizer's own ``step()`` through its step hooks."""

    def __init__(self, optimizer):
        self.seconds = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t0


def _configs(clip):
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip, "steps_per_print": 10 ** 9}
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
    bf16 = {"bf16": {"enabled": True}}
    return {
        PAIRS[0][1]: ("ours", {**base, "megatron": {}}),
        PAIRS[0][2]: ("deepspeed", dict(base)),
        PAIRS[1][1]: ("ours", {**base, **bf16, "megatron": {}}),
        PAIRS[1][2]: ("deepspeed", {**base, **bf16}),
        PAIRS[2][1]: ("ours", {**base, **fp16, "megatron": {}}),
        PAIRS[2][2]: ("deepspeed", {**base, **fp16}),
        PAIRS[3][1]: ("ours", {**base, **bf16, "megatron": {"use_distributed_optimizer": True}}),
        PAIRS[3][2]: ("deepspeed", {**base, **bf16, "zero_optimization": {"stage": 1}}),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-millions", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--clip", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.update(local_rank_env(0, 1, free_port()))
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    import ds_megatron
    from ds_megatron.integration.runtime import init_distributed, set_deepspeed_log_level
    torch.set_num_threads(args.threads)
    set_deepspeed_log_level("ERROR")
    init_distributed(verbose=False)
    get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's fp16 optimizer, on a CPU (see above)

    width = 1024
    depth = max(1, int(args.params_millions * 1e6 / (width * width + 3 * width)))
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))

    engines = {}
    for name, (kind, cfg) in _configs(args.clip).items():
        model = _model(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        timer = _InnerTimer(opt)
        if kind == "ours":
            engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=opt, config=cfg)
        else:
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        dtype = next(engine.module.parameters()).dtype
        engines[name] = (engine, timer, x.to(dtype))

    plain_params = [p.detach().clone().requires_grad_() for p in _model(width, depth).parameters()]
    plain = torch.optim.AdamW(plain_params, lr=1e-4)
    grads = [torch.randn_like(p) * 1e-3 for p in plain_params]

    steps = {name: [] for name in engines}
    inner = {name: [] for name in engines}
    overflows = {name: 0 for name in engines}
    plain_times = []
    for rnd in range(args.warmup + args.rounds):
        for p, g in zip(plain_params, grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        plain.step()
        if rnd >= args.warmup:
            plain_times.append(time.perf_counter() - t0)
        for name, (engine, timer, xin) in engines.items():
            loss = engine(xin).float().pow(2).mean()
            engine.backward(loss)
            timer.seconds = 0.0
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if rnd >= args.warmup:
                if getattr(engine.optimizer, "overflow", False):
                    overflows[name] += 1
                    continue
                steps[name].append(elapsed)
                inner[name].append(timer.seconds)

    n = sum(p.numel() for p in plain_params)
    print(f"{n / 1e6:.1f}M params, {depth} x (Linear({width}) + LayerNorm), torch {torch.__version__}, "
          f"DeepSpeed {deepspeed.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cores; "
          f"median of {args.rounds} rounds; clipping at {args.clip} (active in every variant)")
    print(f"plain torch AdamW fp32 step: {statistics.median(plain_times) * 1e3:.1f} ms")
    print(f"{'variant':46s} {'step ms':>8s} {'inner ms':>9s} {'overhead ms':>12s} {'ours / DeepSpeed':>17s}")
    overhead = {}
    for name in engines:
        if not steps[name]:
            print(f"{name:46s} every timed step overflowed")
            continue
        overhead[name] = statistics.median([s - i for s, i in zip(steps[name], inner[name])])
    for precision, ours, theirs in PAIRS:
        for name in (ours, theirs):
            if name not in overhead:
                continue
            ratio = f"{overhead[ours] / overhead[theirs]:.2f}x" if name == ours and theirs in overhead else ""
            note = f" ({overflows[name]} overflowed steps left out)" if overflows[name] else ""
            print(f"{name:46s} {statistics.median(steps[name]) * 1e3:8.1f} {statistics.median(inner[name]) * 1e3:9.1f}"
                  f" {overhead[name] * 1e3:12.2f} {ratio:>17s}{note}")


if __name__ == "__main__":
    main()
