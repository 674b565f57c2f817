"""Long sequences on 4 CPU ranks: per context-parallel exchange, with and without selective recomputation and
tiling, the peak activation memory of one forward + backward next to the plan, the step time, and the bytes the
CP groups move next to the plan's formula; then the longest sequence under a per-rank memory cap.

    python launch/bench/bench_long_sequence.py [--seqs 512 1024 2048 4096 --cap-mib 64 --layers 2 --hidden 128
                                                --heads 8 --vocab 1024]

Layouts (4 ranks): ``none`` (no CP: each rank holds the whole sequence, 4 data-parallel replicas), ``p2p``
(ring CP 4), ``a2a`` (Ulysses CP 4), ``a2a+p2p`` (hierarchical 2 x 2).  Variants: ``plain``, and ``lean``:
selective recomputation of ``core_attn``, ``mlp`` and ``layernorm`` with the MLP and the loss over 4 sequence tiles.
Peaks come from the CPU allocator's trace (``utils.memory.peak_allocated_bytes``, the highest running total of
allocations during the pass, the gradients allocated before it as the job's buffers are); the plan is
``planning.memory.activation_bytes``; bytes are the CP groups' bus bytes counted by ``utils.collectives.count_bytes``
against ``planning.comm_volume``.  The 4 ranks share the box's cores, so step
times are for ordering, not absolute.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402

LAYOUTS = {"none": (1, None), "p2p": (4, None), "a2a": (4, None), "a2a+p2p": (4, [2, 2])}
LEAN = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"],
            mlp_sequence_tiles=4, loss_sequence_tiles=4)


def _config(args, seq, layout, variant):
    from ds_megatron.models import GPTConfig
    cp, _ = LAYOUTS[layout]
    extra = LEAN if variant == "lean" else {}
    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                     ffn_hidden_size=4 * args.hidden, seq_length=seq, vocab_size=args.vocab, hidden_dropout=0.0,
                     attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                     cp_comm_type="p2p" if layout == "none" else layout, make_vocab_size_divisible_by=128, **extra)


def _measure(args, seq, layout, variant):
    import torch
    import torch.distributed as dist
    from ds_megatron.models import GPTModel
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.utils.collectives import count_bytes
    from ds_megatron.utils.memory import peak_allocated_bytes
    cp, hierarchical = LAYOUTS[layout]
    state = ParallelState.build(ParallelLayout(world_size=dist.get_world_size(), cp=cp))
    if hierarchical:
        state.build_hierarchical_context_parallel(hierarchical[0])
    torch.manual_seed(0)
    model = GPTModel(_config(args, seq, layout, variant), state)
    tokens = torch.randint(0, args.vocab, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    model(batch).backward()  # warm-up: lazily made state is not an activation

    for p in model.parameters():  # the job's gradients live in its buffers, allocated before any pass
        p.grad = torch.zeros_like(p)

    def one_pass():
        for p in model.parameters():
            p.grad.zero_()
        model(batch).backward()

    dist.barrier()
    t0 = time.perf_counter()
    one_pass()  # timed without the profiler
    seconds = time.perf_counter() - t0
    with count_bytes() as counter:
        peak = peak_allocated_bytes(one_pass)[0]
    moved = sum(r.bus_bytes for r in counter.records if r.group in ("cp", "hcp-a2a", "hcp-p2p"))
    out = torch.tensor([peak, seconds, moved], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    state.destroy()
    rows = torch.stack(gathered)
    return float(rows[:, 0].max()), float(rows[:, 1].max()), float(rows[:, 2].max())


def _planned(args, seq, layout, variant):
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.planning.comm_volume import plan_comm_volume
    from ds_megatron.planning.memory import activation_bytes
    cfg = _config(args, seq, layout, variant)
    cp, hierarchical = LAYOUTS[layout]
    inner = hierarchical[0] if hierarchical else None
    activations = activation_bytes(cfg, 1, 1, "fp32", cp=cp, hierarchical_inner=inner)
    plan, = plan_comm_volume(cfg, ParallelLayout(world_size=4, cp=cp), "fp32", micro_batch=1, micro_batches=1,
                             hierarchical_inner=inner)
    moved = sum(v for k, v in plan.bus_bytes.items() if k in ("cp", "hcp-a2a", "hcp-p2p"))
    return activations, moved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--cap-mib", type=float, default=64.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    args = ap.parse_args(argv)
    mib = 2 ** 20
    print(f"4 ranks on {os.cpu_count()} cores (gloo); GPT {args.layers} layers x hidden {args.hidden}, {args.heads} "
          f"heads, vocab {args.vocab}, fp32, micro-batch 1; one forward + backward; cap {args.cap_mib:g} MiB")
    print(f"{'layout':>8s} {'variant':>7s} {'seq':>6s} {'peak MiB':>9s} {'plan MiB':>9s} {'step ms':>8s} "
          f"{'CP MB':>8s} {'plan MB':>8s}")
    longest, predicted = {}, {}
    for layout in args.layouts:
        for variant in ("plain", "lean"):
            for seq in args.seqs:
                peak, seconds, moved = run_local_job(4, _measure, args, seq, layout, variant)
                plan_act, plan_moved = _planned(args, seq, layout, variant)
                print(f"{layout:>8s} {variant:>7s} {seq:>6d} {peak / mib:>9.1f} {plan_act / mib:>9.1f} "
                      f"{seconds * 1e3:>8.0f} {moved / 1e6:>8.3f} {plan_moved / 1e6:>8.3f}", flush=True)
                if peak / mib <= args.cap_mib:
                    longest[(layout, variant)] = seq
                if plan_act / mib <= args.cap_mib:
                    predicted[(layout, variant)] = seq
    print(f"\nlongest sequence (of {args.seqs}) whose peak stays under {args.cap_mib:g} MiB per rank, measured "
          "(planned):")
    for layout in args.layouts:
        print(f"  {layout:>8s}: " + ", ".join(f"{v} {longest.get((layout, v), '-')} ({predicted.get((layout, v), '-')})"
                                              for v in ("plain", "lean")))


if __name__ == "__main__":
    main()
