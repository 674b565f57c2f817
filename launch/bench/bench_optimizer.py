"""Per-step optimizer overhead: our Megatron path vs DeepSpeed's own bf16 optimizer vs a plain fp32 step.

One process (world size 1), one model, the same AdamW update everywhere; each
variant times ``engine.step()`` with fresh gradients set before each step, and
reports the overhead over a plain ``torch.optim.AdamW.step()`` on fp32 params
(unscale + inf/nan check + global norm + clip + copies; DeepSpeed's fp16 refuses
to run on CPUs, so its bf16 optimizer stands in).  Usage:

    python launch/bench/bench_optimizer.py [--params-millions 8] [--steps 20]
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_megatron.utils.local_job import local_rank_env, free_port  # noqa: E402


def _model(width, depth):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers)


def _time_steps(step, set_grads, steps):
    times = []
    for _ in range(steps + 2):
        set_grads()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first two warm up allocations and optimizer state


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-millions", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    os.environ.update(local_rank_env(0, 1, free_port()))
    import torch
    import ds_megatron
    from ds_megatron.integration.runtime import prepare_cpu_runtime
    prepare_cpu_runtime()
    width = 1024
    depth = max(1, int(args.params_millions * 1e6 / (width * width + 3 * width)))
    base = _model(width, depth)
    x = torch.randn(8, width)
    base(x).pow(2).mean().backward()
    grads = [p.grad.detach().clone() for p in base.parameters()]
    n = sum(p.numel() for p in base.parameters())

    # Plain fp32 AdamW step: the work every variant shares.
    params = [p.detach().clone().requires_grad_() for p in base.parameters()]
    plain = torch.optim.AdamW(params, lr=1e-4)

    def set_plain():
        for p, g in zip(params, grads):
            p.grad = g.clone()
    results = {"plain torch AdamW fp32": _time_steps(plain.step, set_plain, args.steps)}

    variants = {
        "ours fp32 (FP32Optimizer)": {},
        "ours bf16 (Float16Optimizer)": {"bf16": {"enabled": True}},
        "ours fp16 (Float16Optimizer)": {"fp16": {"enabled": True, "initial_scale_power": 8}},
        "deepspeed bf16 (its FP16_Optimizer)": {"bf16": {"enabled": True}, "megatron": {"optimizer_impl": "deepspeed"}},
        "deepspeed fp32 (client AdamW)": {"megatron": {"optimizer_impl": "deepspeed"}},
    }
    for name, extra in variants.items():
        model = _model(width, depth)
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
               "megatron": {}}
        cfg.update({k: v for k, v in extra.items() if k != "megatron"})
        cfg["megatron"].update(extra.get("megatron", {}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = ds_megatron.initialize(model=model, optimizer=opt, config=cfg)
        model_params = list(engine.module.parameters())
        scale = getattr(engine.optimizer, "cur_scale", None) or 1.0
        ddp = engine.megatron.ddp  # on our path the gradient buffers hold the grads (main_grad)

        def set_grads():
            if ddp is not None:
                ddp.zero_grad_buffer()  # a new accumulation window, as the next forward would start
            for p, g in zip(model_params, grads):
                if ddp is not None:
                    p.main_grad.copy_(g * scale)
                else:
                    p.grad = (g * scale).to(p.dtype)
        results[name] = _time_steps(engine.step, set_grads, args.steps)
        engine.megatron.state.destroy()

    ref = results["plain torch AdamW fp32"]
    ours = results["ours bf16 (Float16Optimizer)"] - ref
    print(f"{n / 1e6:.1f}M params, {depth} x Linear({width}) + LayerNorm, median of {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'variant':40s} {'step ms':>9s} {'overhead ms':>12s} {'overhead / ours bf16':>21s}")
    for name, t in results.items():
        over = t - ref
        ratio = f"{over / ours:.2f}x" if name != "plain torch AdamW fp32" else "-"
        print(f"{name:40s} {t * 1e3:9.1f} {over * 1e3:12.1f} {ratio:>21s}")


if __name__ == "__main__":
    main()
