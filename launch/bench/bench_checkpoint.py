"""Checkpoint save and load time of a ~100M-parameter GPT job: each checkpoint format next to torch.save / torch.load.

    python launch/bench/bench_checkpoint.py [--layers 12 --hidden 768 --heads 12 --vocab 8192] [--repeats 3]
        [--layouts fp32-tp1,fp32-tp2,bf16-distopt-dp2] [--formats deepspeed,torch_dist] [--dir runs/bench_checkpoint]

Per layout, one gloo job trains one step through the real engine (so the
optimizer holds its state), then runs, ``--repeats`` times in turn, each format's
save, the floor's save, each format's load and the floor's load:

* ``deepspeed``: ``ds_megatron.save_checkpoint`` / ``load_checkpoint`` (DeepSpeed's
  own files, one per tensor-parallel rank written by data-parallel rank 0; with the
  distributed optimizer the gather of every shard first);
* ``torch_dist``: the layout-independent format (``ds_megatron.checkpointing.torch_dist``:
  every rank writes its own shards with ``torch.distributed.checkpoint``); left out
  when this checkout has no such module;
* the floor: ``torch.save`` of the same tensors (the module's state and the
  optimizer's state, gathered as DeepSpeed's file holds it) by the same writers, one
  file each, and ``torch.load`` + ``load_state_dict`` of that file on every rank.

Times are the max over ranks, medians over repeats; MB/s counts the bytes the
files hold.  Files go to ``--dir`` on disk; reads that follow writes come mostly
from the page cache, as when a job resumes on the machine that saved.  A new
format is one entry in ``_formats``: a name and its save / load functions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402

LAYOUTS = {  # name: (ranks, DeepSpeed precision section, "megatron" section)
    "fp32-tp1": (1, {}, {}),
    "fp32-tp2": (2, {}, {"tensor_model_parallel_size": 2}),
    "bf16-distopt-dp2": (2, {"bf16": {"enabled": True}}, {"use_distributed_optimizer": True}),
}


def _formats():
    """name -> (save(engine, directory), load(engine, directory)); each saves and loads every rank's state."""
    import ds_megatron
    return {"deepspeed": (lambda engine, d: ds_megatron.save_checkpoint(engine, d, tag="t"),
                          lambda engine, d: ds_megatron.load_checkpoint(engine, d, tag="t")),
            "torch_dist": (lambda engine, d: ds_megatron.save_dist_checkpoint(engine, d),
                           lambda engine, d: ds_megatron.load_dist_checkpoint(engine, d))}


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _job(args, layout):
    import torch
    import torch.distributed as dist

    import ds_megatron
    from ds_megatron.integration.runtime import set_deepspeed_log_level
    from ds_megatron.models import GPTConfig, GPTModel
    set_deepspeed_log_level("ERROR")
    _, precision, megatron = LAYOUTS[layout]
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, **precision, "megatron": dict(megatron)}
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    gpt = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=64,
                    vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(gpt, state)
    engine, optimizer, _, _ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    tokens = torch.randint(0, args.vocab, (1, 65))
    engine.backward(engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}))
    engine.step()
    rank = dist.get_rank()
    formats = {k: v for k, v in _formats().items() if k in args.formats}
    root = os.path.join(args.dir, layout)
    floor_path = os.path.join(root, "floor", f"tp{state.tp.rank}.pt")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.dirname(floor_path), exist_ok=True)
    dist.barrier()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out)

    def floor_save():
        # The tensors DeepSpeed's file holds: the module's state and the optimizer's (gathered: a collective
        # with the distributed optimizer), written by data-parallel rank 0 of each tensor-parallel rank.
        saved = {"module": engine.module.state_dict(), "optimizer": optimizer.state_dict()}
        if state.dp.rank == 0:
            torch.save(saved, floor_path)

    def floor_load():
        saved = torch.load(floor_path, map_location="cpu", weights_only=False)
        engine.module.load_state_dict(saved["module"])
        optimizer.load_state_dict(saved["optimizer"])

    times = {(name, what): [] for name in [*formats, "floor"] for what in ("save", "load")}
    for _ in range(args.repeats):
        for name, (save, _) in formats.items():
            directory = os.path.join(root, name)
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
            dist.barrier()
            times[name, "save"].append(timed(lambda: save(engine, directory)))
        times["floor", "save"].append(timed(floor_save))
        for name, (_, load) in formats.items():
            times[name, "load"].append(timed(lambda: load(engine, os.path.join(root, name))))
        times["floor", "load"].append(timed(floor_load))
    dist.barrier()
    sizes = {name: _dir_bytes(os.path.join(root, name)) for name in [*formats, "floor"]}
    params = sum(p.numel() for p in model.parameters()) * state.tp.size  # the whole model (TP splits it)
    if engine.megatron.ddp_in_engine is not None:
        engine.megatron.ddp_in_engine.detach()
    state.destroy()
    return {"layout": layout, "params": params, "bytes": sizes,
            "times": {f"{n} {w}": statistics.median(v) for (n, w), v in times.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(ROOT, "runs", "bench_checkpoint"))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--formats", default="deepspeed,torch_dist", help="comma-separated: deepspeed, torch_dist")
    args = ap.parse_args(argv)
    args.formats = args.formats.split(",")
    for name in args.formats:
        if name not in ("deepspeed", "torch_dist"):
            ap.error(f"--formats: {name!r} is not deepspeed or torch_dist")
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            ap.error(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    rows = [run_local_job(LAYOUTS[name][0], _job, args, name,
                          threads_per_rank=max(1, (os.cpu_count() or 1) // LAYOUTS[name][0]), timeout=3600)
            for name in args.layouts.split(",")]
    print(f"\nGPT l={args.layers} h={args.hidden} V={args.vocab}, AdamW state; {os.cpu_count()} cores; files in "
          f"{args.dir}; median of {args.repeats}, max over ranks; floor: torch.save / torch.load of the same tensors")
    print(f"{'layout':17s} {'params':>7s} {'format':11s} {'what':5s} {'s':>7s} {'floor s':>8s} {'x floor':>8s} "
          f"{'MB':>7s} {'floor MB':>9s} {'MB/s':>7s} {'floor MB/s':>11s}")
    for r in rows:
        floor_mb = r["bytes"]["floor"] / 1e6
        for what in ("save", "load"):
            floor = r["times"][f"floor {what}"]
            for name in args.formats:
                t, mb = r["times"][f"{name} {what}"], r["bytes"][name] / 1e6
                print(f"{r['layout']:17s} {r['params'] / 1e6:6.1f}M {name:11s} {what:5s} {t:7.2f} {floor:8.2f} "
                      f"{t / floor:7.2f}x {mb:7.0f} {floor_mb:9.0f} {mb / t:7.0f} {floor_mb / floor:11.0f}")


if __name__ == "__main__":
    main()
