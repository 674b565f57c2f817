"""Step time and CPU launch overhead with and without partial CUDA graphs, small MoE GPT, micro-batch 1.

Many small layers and micro-batch 1 make the step launch-bound, which is
where graphs pay.  For each variant (eager; each partial scope; whole layers
for the dense model) it times ``forward + backward`` per micro-batch on one
GPU, and separately the CPU time spent issuing the step (wall time until the
Python side returns, before ``torch.cuda.synchronize``), and reports the
speed-up and the extra memory the graphs hold (static buffers, graph pool,
tensor store) against eager, for comparison with the seed's memory table.

    python launch/bench/bench_cuda_graphs.py [--layers 24] [--hidden 256] [--seq 256] [--experts 8] [--steps 30]

Needs a CUDA device; on a CPU-only machine it says so and exits with status 2.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--capturer", choices=["auto", "torch", "te"], default="auto")
    return p.parse_args()


def _model(args, moe):
    import torch
    from ds_megatron.models import GPTConfig, GPTModel
    cfg = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
               ffn_hidden_size=4 * args.hidden, seq_length=args.seq, vocab_size=1024, hidden_dropout=0.0,
               attention_dropout=0.0, make_vocab_size_divisible_by=128)
    if moe:
        cfg.update(num_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.hidden,
                   moe_aux_loss_coeff=0.01)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return GPTModel(GPTConfig(**cfg)).cuda().to(dtype)


def _capturer(name):
    from ds_megatron.cuda_graphs.backends import TorchCapturer, TransformerEngineCapturer, default_capturer
    if name == "torch":
        return TorchCapturer()
    if name == "te":
        return TransformerEngineCapturer()
    return default_capturer("transformer_engine", "cuda")[0]


def _time(model, args, batch):
    import torch
    tokens, labels = batch
    cpu, total = [], []
    for i in range(args.steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(tokens, labels)
        loss.backward()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if i >= 3:
            cpu.append(t1 - t0)
            total.append(t2 - t0)
    return statistics.median(total) * 1e3, statistics.median(cpu) * 1e3


def _variant(args, moe, scope, batch):
    import torch
    from ds_megatron.config import CudaGraphConfig
    from ds_megatron.cuda_graphs.capture import CudaGraphHelper
    model = _model(args, moe)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    helper = None
    if scope is not None:
        helper = CudaGraphHelper(list(model.layers), CudaGraphConfig(impl="transformer_engine", scope=scope),
                                 _capturer(args.capturer))
        loss = model(*batch)  # one eager step records the layers' input shapes
        loss.backward()
        model.zero_grad(set_to_none=True)
        helper.create_cudagraphs()
    held = torch.cuda.memory_allocated() - base
    step_ms, cpu_ms = _time(model, args, batch)
    peak = torch.cuda.max_memory_allocated() - base
    del helper, model
    torch.cuda.empty_cache()
    return step_ms, cpu_ms, held, peak


def main():
    args = _parse()
    import torch
    if not torch.cuda.is_available():
        print("bench_cuda_graphs: no CUDA device (torch.cuda.is_available() is False); CUDA graphs need one. "
              "Run this on a GPU machine.", file=sys.stderr)
        sys.exit(2)
    g = torch.Generator(device="cuda").manual_seed(0)
    batch = (torch.randint(0, 1024, (1, args.seq), device="cuda", generator=g),
             torch.randint(0, 1024, (1, args.seq), device="cuda", generator=g))
    variants = [("dense", False, None), ("dense", False, ["attn"]), ("dense", False, []),
                ("moe", True, None), ("moe", True, ["attn"]), ("moe", True, ["attn", "moe_router"]),
                ("moe", True, ["attn", "moe_router", "moe_preprocess"])]
    print(f"{torch.cuda.get_device_name()} | layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"experts={args.experts} topk={args.topk} micro-batch=1 {args.dtype}")
    print(f"{'model':6} {'scope':40} {'step ms':>8} {'cpu ms':>8} {'speed-up':>9} {'held MiB':>9} {'peak MiB':>9}")
    eager = {}
    for name, moe, scope in variants:
        step_ms, cpu_ms, held, peak = _variant(args, moe, scope, batch)
        if scope is None:
            eager[name] = step_ms
        label = "eager" if scope is None else (",".join(scope) or "whole layer")
        print(f"{name:6} {label:40} {step_ms:8.2f} {cpu_ms:8.2f} {eager[name] / step_ms:8.2f}x "
              f"{held / 2**20:9.1f} {peak / 2**20:9.1f}")


if __name__ == "__main__":
    main()
