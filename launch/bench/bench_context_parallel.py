"""Context parallelism on CPU: per-rank activation memory, step time and hidden K/V exchange for CP=1, 2, 4.

    python launch/bench/bench_context_parallel.py [--seq 4096 8192] [--cp 1 2 4] [--layers 2 --hidden 256]

For each sequence length and CP size, one gloo job of CP ranks (spawned here,
one thread each) builds the same GPT (``GPTModel``, learned positions, no
dropout, fp32, micro-batch 1) and runs forward + backward of one whole
sample; every rank keeps its two zigzag chunks (``s / cp`` tokens).  Printed
side by side, per CP size (the largest rank):

* activation memory: what the forward keeps for backward, the bytes still
  allocated when the forward returns over what was alive before it
  (``utils.memory.peak_allocated_bytes``: torch's profiler, the method
  ``ds-megatron plan``'s tests use), and its ratio to CP=1; next to it the
  peak over forward + backward (which adds the parameter gradients and the
  backward's transients) and the plan (``planning.activation_bytes``);
* step time: median forward + backward over ``--repeats`` runs;
* K/V exchange hidden: the ring's point-to-point traffic measured three ways
  on the attention core alone (``context_parallel_attention``, p2p, forward +
  backward): as run (``t_ring``), with each exchange replaced by a local copy
  (``t_compute``: the same blocks, no traffic) and the exchanges alone
  (``t_comm``: the same messages, no compute).  Hidden share
  ``= (t_compute + t_comm - t_ring) / t_comm``, clipped to [0, 1].

On a machine with fewer cores than ranks the ranks share cores: step times
then include that contention (the hidden share too), memory does not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _attention_core_times(args, seq, state):
    """(t_ring, t_compute, t_comm) of the p2p attention core's forward + backward on this rank."""
    import torch

    from ds_megatron.transformer import context_parallel as cpa
    from ds_megatron.utils.collectives import ring_exchange
    cp = state.cp
    heads, d = args.heads, args.hidden // args.heads
    local = seq // cp.size
    gen = torch.Generator().manual_seed(cp.rank)
    q, k, v = (torch.randn(1, heads, local, d, generator=gen, requires_grad=True) for _ in range(3))

    def core():
        out = cpa.context_parallel_attention(q, k, v, cp, "p2p")
        out.backward(torch.ones_like(out))

    t_ring = _timed(core, args.repeats)
    real = cpa.ring_exchange

    def local_copy(send, recv, group, tag=0):  # the same blocks on this rank's own K/V, no traffic
        recv.copy_(send)
        return []
    cpa.ring_exchange = local_copy
    try:
        t_compute = _timed(core, args.repeats)
    finally:
        cpa.ring_exchange = real
    kv = torch.empty(2, 1, heads, local, d)

    def exchanges():
        # Forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp dK/dV hops, each waited in turn.
        for _ in range(3 * cp.size - 2):
            incoming = torch.empty_like(kv)
            for w in ring_exchange(kv, incoming, cp):
                w.wait()
    t_comm = _timed(exchanges, args.repeats) if cp.size > 1 else 0.0
    return t_ring, t_compute, t_comm


def _measure(args, seq):
    """One rank's figures; rank 0 returns every rank's."""
    import torch
    import torch.distributed as dist

    from ds_megatron.models import GPTConfig, GPTModel
    from ds_megatron.parallel.layout import ParallelLayout
    from ds_megatron.parallel_state import ParallelState
    from ds_megatron.planning import activation_bytes
    from ds_megatron.utils.memory import peak_allocated_bytes
    cp = dist.get_world_size()
    state = ParallelState.build(ParallelLayout(world_size=cp, cp=cp))
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=seq, vocab_size=257, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(cfg, state)
    tokens = torch.randint(0, 257, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def step():
        model(batch).backward()
        for p in model.parameters():
            p.grad = None
    step()  # warm: lazily made state (RNG, caches, the rotary tables) is not an activation
    dist.barrier()
    _, kept, loss = peak_allocated_bytes(lambda: model(batch))
    del loss
    peak, _, _ = peak_allocated_bytes(lambda: model(batch).backward())
    for p in model.parameters():
        p.grad = None
    dist.barrier()
    step_time = _timed(step, args.repeats)
    dist.barrier()
    core = _attention_core_times(args, seq, state)
    mine = {"kept": kept, "peak": peak, "plan": activation_bytes(cfg, 1, 1, "fp32", cp=cp), "step": step_time, "core": core}
    everyone = [None] * cp
    dist.all_gather_object(everyone, mine)
    state.destroy()
    return everyone


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab 257, fp32, micro-batch 1, "
          f"CPU gloo, 1 thread per rank, {os.cpu_count()} cores; forward + backward of one sample")
    for seq in args.seq:
        rows, base = [], None
        for cp in args.cp:
            ranks = run_local_job(cp, _measure, args, seq, timeout=args.timeout)
            kept, peak = max(r["kept"] for r in ranks), max(r["peak"] for r in ranks)
            base = base or kept
            t_ring, t_compute, t_comm = (max(r["core"][i] for r in ranks) for i in range(3))
            hidden = max(0.0, min(1.0, (t_compute + t_comm - t_ring) / t_comm)) if t_comm else float("nan")
            rows.append((cp, kept, kept / base, peak, ranks[0]["plan"], max(r["step"] for r in ranks), t_ring, t_compute,
                         t_comm, hidden))
        print(f"\nseq {seq}")
        print(f"{'cp':>3} {'act. MiB/rank':>14} {'vs cp=1':>8} {'peak MiB':>9} {'plan MiB':>9} {'step s':>7} "
              f"{'core ring s':>12} {'compute s':>10} {'comm s':>7} {'K/V hidden':>11}")
        for cp, kept, ratio, peak, plan, step, t_ring, t_compute, t_comm, hidden in rows:
            print(f"{cp:>3} {kept / 2 ** 20:>14.1f} {ratio:>7.2f}x {peak / 2 ** 20:>9.1f} {plan / 2 ** 20:>9.1f} {step:>7.2f} "
                  f"{t_ring:>12.3f} {t_compute:>10.3f} {t_comm:>7.3f} {hidden:>10.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
