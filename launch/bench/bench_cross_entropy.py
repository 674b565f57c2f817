"""The GPT's output layer + loss, forward and backward: vocab-parallel cross entropy next to torch's and the GEMMs.

    python launch/bench/bench_cross_entropy.py [--tokens 1024 --hidden 256 --vocab 8192 --rounds 15 --threads 2]

One process (TP=1), fp32, the GPT's shape: ``logits = hidden @ E^T`` ([tokens, vocab])
then the per-token loss, its mean, and backward into ``hidden`` and ``E``.  Rows:

* GEMMs only: the same matmuls with a loss that reads nothing (``logits.sum()``'s
  backward is a broadcast): the floor the loss adds to;
* torch ``F.cross_entropy`` on the logits;
* ours, as a caller gets it (``vocab_parallel_cross_entropy``: the caller's logits are kept);
* ours with ``inplace=True`` (the logits handed over: the softmax is computed in their
  storage and the gradient in the softmax's);
* ours as the GPT calls it: ``linear_vocab_parallel_cross_entropy``, the output layer
  included, logits computed transposed (``E @ x^T``) into a ``LogitsBuffer`` kept
  across steps (its "loss ms" can be negative: its GEMMs beat F.linear's).

The variants run round-robin (one of each per round) and report the median;
"loss ms" is the row minus the GEMMs-only row.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from ds_megatron.parallel_state import ParallelGroup
    from ds_megatron.tensor_parallel import vocab_parallel_cross_entropy
    try:
        from ds_megatron.tensor_parallel import LogitsBuffer, linear_vocab_parallel_cross_entropy
    except ImportError:  # an older checkout
        LogitsBuffer = linear_vocab_parallel_cross_entropy = None
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.tokens, args.hidden, generator=g)).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    tp = ParallelGroup.single("tp")

    def ours(inplace):
        def loss(logits):
            kwargs = {"inplace": True} if inplace else {}
            return vocab_parallel_cross_entropy(logits, target, tp, **kwargs).mean()
        return loss

    class _NoLoss(torch.autograd.Function):
        """Reads nothing; backward hands the GEMMs a dense gradient (an expanded one would slow them)."""
        grad = torch.full((args.tokens, args.vocab), 1.0 / args.tokens)

        @staticmethod
        def forward(ctx, logits):
            return logits.new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            return _NoLoss.grad

    variants = {
        "GEMMs only (no loss)": _NoLoss.apply,
        "torch F.cross_entropy": lambda logits: F.cross_entropy(logits, target),
        "ours, caller's logits kept": ours(False),
        "ours, in place": ours(True),
        "ours, output layer + loss (the GPT)": None,
    }
    buffer = LogitsBuffer() if linear_vocab_parallel_cross_entropy is not None else None

    def fused():
        return linear_vocab_parallel_cross_entropy(hidden, weight, target, tp, buffer=buffer).mean()
    times = {name: [] for name in variants}
    losses = {}
    for rnd in range(args.warmup + args.rounds):
        for name, fn in variants.items():
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            try:
                loss = fused() if fn is None else fn(F.linear(hidden, weight))
            except (TypeError, AttributeError):  # an older checkout without inplace= / the fused function
                continue
            loss.backward()
            elapsed = time.perf_counter() - t0
            losses[name] = float(loss.detach())
            if rnd >= args.warmup:
                times[name].append(elapsed)
    floor = statistics.median(times["GEMMs only (no loss)"])
    print(f"tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, fp32, {torch.get_num_threads()} "
          f"thread(s), torch {torch.__version__}; median of {args.rounds} rounds, forward + backward")
    print(f"{'variant':40s} {'ms':>8s} {'loss ms':>8s} {'loss':>9s}")
    for name, ts in times.items():
        if not ts:
            print(f"{name:40s} {'n/a':>8s}")
            continue
        t = statistics.median(ts)
        extra = f"{(t - floor) * 1e3:8.1f}" if name != "GEMMs only (no loss)" else f"{'-':>8s}"
        value = f"{losses[name]:9.5f}" if name != "GEMMs only (no loss)" else f"{'-':>9s}"
        print(f"{name:40s} {t * 1e3:8.1f} {extra} {value}")


if __name__ == "__main__":
    main()
