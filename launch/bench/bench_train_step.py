"""What the training step costs beyond the model's own forward + backward, one process, one device.

    python launch/bench/bench_train_step.py [--layers 24 --hidden 1024 --heads 16 --seq 1024 --mbs 8
        --vocab 50257] [--steps 15] [--distributed-optimizer]

Two rows, same GPT, same batch, in one run: the model alone (bf16 parameters, ``loss.backward()``, nothing
else) and the full ``ds_megatron.initialize`` bf16 step (Float16 optimizer path: fp32 main parameters in the
gradient buffer, unscale, global-norm clipping, AdamW, the bf16 copy back). Time per step is the median of
``--steps`` after 3 warm-ups, synchronized on a GPU. The ratio is what the optimizer path costs; the default
shape is a 350M-parameter GPT-2 (medium) for a GPU. On a CPU, pass a small shape.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 24), ("hidden", 1024), ("heads", 16), ("seq", 1024), ("mbs", 8),
                          ("vocab", 50257), ("steps", 15)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--distributed-optimizer", action="store_true")
    args = p.parse_args()
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "29533")):
        os.environ.setdefault(k, v)

    import torch

    import ds_megatron
    from ds_megatron.integration.runtime import set_deepspeed_log_level
    from ds_megatron.models import GPTConfig, GPTModel
    set_deepspeed_log_level("ERROR")
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
           "megatron": {"use_distributed_optimizer": args.distributed_optimizer}}
    state = ds_megatron.initialize_model_parallel(cfg)
    gpt = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), device=device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def median_s(fn):
        times = []
        for _ in range(args.steps + 3):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])

    torch.manual_seed(0)
    model = GPTModel(gpt, state).to(device, torch.bfloat16)
    t_model = median_s(lambda: model(batch).backward())
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    engine, *_ = ds_megatron.initialize(model=GPTModel(gpt, state), config=cfg, parallel_state=state)

    def step():
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    t_step = median_s(step)
    n = args.mbs * args.seq
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name} | GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.mbs}, "
          f"vocab {args.vocab}, bf16, distributed optimizer {args.distributed_optimizer}")
    print(f"{'path':42s} {'ms':>8s} {'tokens/s':>10s} {'x of fwd+bwd':>13s}")
    print(f"{'model forward + backward only':42s} {t_model * 1e3:8.1f} {n / t_model:10,.0f} {1.0:12.2f}x")
    print(f"{'ds_megatron.initialize step':42s} {t_step * 1e3:8.1f} {n / t_step:10,.0f} {t_model / t_step:12.2f}x")
    if cuda:
        print(f"peak memory of the step: {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB")


if __name__ == "__main__":
    main()
