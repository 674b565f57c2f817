"""Packed sequences against one document per padded row: trained tokens per second, and the packing efficiency.

    python launch/bench/bench_packing.py [--seq 4096 --docs 400 --median 300 --sigma 1.0] [--layers 2
        --hidden 256 --heads 4 --vocab 8192] [--rows 6]

Documents of long-tailed lengths (log-normal, median ``--median`` tokens, at most ``--seq``), the same set both
ways, in one run:

* padded: each document alone in a row of ``--seq`` tokens, the rest padding (loss-masked; causal attention over
  the whole row, as a padded batch runs);
* packed: the documents packed by best-fit-decreasing (``ds_megatron.data.sft.best_fit_decreasing``, what
  ``ds-megatron preprocess --sft`` runs) into rows of ``--seq``, each document attending only to itself
  (``position_ids`` restarting per document: ``PackedSeqParams``, one attention call per document).

Both train the same GPT (one forward + backward per row, micro-batch 1; bf16 on a GPU, fp32 on a CPU).  A row's
trained tokens are its documents' tokens but each one's last; the rate is trained tokens over the median time of
``--rows`` rows (after a warm-up row), rows taken from the start of each list.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("seq", 4096), ("docs", 400), ("median", 300), ("layers", 2), ("hidden", 256),
                          ("heads", 4), ("vocab", 8192), ("rows", 6), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--sigma", type=float, default=1.0, help="of the log-normal lengths' logarithm")
    args = p.parse_args()

    import numpy as np
    import torch

    from ds_megatron.data.sft import best_fit_decreasing
    from ds_megatron.models import GPTConfig, GPTModel

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median), args.sigma, args.docs)), 2, args.seq).astype(int)
    rows = best_fit_decreasing(lengths.tolist(), args.seq, args.seed)
    efficiency = lengths.sum() / (len(rows) * args.seq)

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0,
                               attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                               gated_linear_unit=True, activation="silu", add_bias_linear=False)).to(device, dtype)

    def row_batch(docs):
        """One row of ``--seq`` tokens holding ``docs`` (lengths), padded after them; position ids restart."""
        used = int(sum(docs))
        tokens = torch.randint(0, args.vocab, (1, args.seq), device=device)
        positions = torch.cat([torch.arange(n) for n in docs] + [torch.arange(args.seq - used)]).to(device)
        mask = torch.zeros(1, args.seq, device=device)
        start = 0
        for n in docs:
            mask[0, start:start + n - 1] = 1  # a document's last token has no label of its own
            start += n
        batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask}
        if len(docs) > 1 or used < args.seq:
            batch["position_ids"] = positions[None]
        return batch, int(mask.sum())

    def rate(batches):
        times, trained = [], []
        for i, (batch, n) in enumerate(batches[:args.rows + 1]):
            sync()
            t0 = time.perf_counter()
            model(batch).backward()
            sync()
            if i:  # the first row warms up
                times.append(time.perf_counter() - t0)
                trained.append(n)
        return statistics.mean(trained) / statistics.median(times), statistics.median(times)

    padded = []
    for n in lengths[:args.rows + 1]:  # a document alone, padding after it: causal attention over the row
        tokens = torch.randint(0, args.vocab, (1, args.seq), device=device)
        mask = torch.zeros(1, args.seq, device=device)
        mask[0, :n - 1] = 1
        padded.append(({"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask}, int(n) - 1))
    packed = [row_batch([int(lengths[i]) for i in row]) for row in rows[:args.rows + 1]]
    padded_rate, padded_s = rate(padded)
    packed_rate, packed_s = rate(packed)
    where = "cuda bf16" if cuda else f"cpu fp32, {torch.get_num_threads()} threads"
    print(f"documents: {args.docs}, log-normal median {int(np.median(lengths))} tokens (mean {lengths.mean():.0f}, "
          f"max {lengths.max()}), seq {args.seq}; model {args.layers} layers x {args.hidden}, {where}")
    print(f"packing: {len(rows)} rows of {args.seq} for {args.docs} documents, efficiency {efficiency:.2%} "
          f"(one document per row: {lengths.mean() / args.seq:.2%})")
    print(f"{'':8} {'s/row':>8} {'trained tok/row':>16} {'trained tok/s':>14}")
    print(f"{'padded':8} {padded_s:8.3f} {padded_rate * padded_s:16.0f} {padded_rate:14,.0f}")
    print(f"{'packed':8} {packed_s:8.3f} {packed_rate * packed_s:16.0f} {packed_rate:14,.0f}")
    print(f"packed / padded: {packed_rate / padded_rate:.2f}x trained tokens per second")


if __name__ == "__main__":
    main()
