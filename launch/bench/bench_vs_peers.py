"""The same GPT trained by ds_megatron, by megatron-core under DeepSpeed and by plain DeepSpeed, next to the matmul peak.

    python launch/bench/bench_vs_peers.py [--sizes h256,h512] [--layouts tp1,tp2,dp2] [--seq 256 --mbs 4
        --vocab 8192] [--threads N] [--rounds 8 --warmup 2] [--no-memory] [--json FILE]

Needs the ``bench`` extra (``pip install --no-deps megatron-core==0.16.1`` and ``transformers``).

One gloo job per layout (``run_local_job``): TP=1 on one rank with all threads,
TP=2 and DP=2 on two ranks with half the threads each.  In every job, for every
size, the three implementations are built side by side on the same batches
(random tokens, the same on each) and train in rounds; each round runs one step
of each (rotating the order), then every rank times a 1024^3 sgemm at its
thread count at once: that round's matmul peak.  So each figure shares its
round's load with the others, which on a shared box matters more than anything.

* ours: ``ds_megatron.initialize`` with the job's ``GPTModel`` (fp32, our gradient
  buffers and ``FP32Optimizer``);
* megatron-core 0.16's ``GPTModel``, local layer spec (no Transformer Engine),
  tied embeddings, learned positions, ``deepspeed.initialize`` with an mpu over
  megatron-core's own groups.  CPU patches, here only: ``torch.cuda.current_device``
  answers "cpu" (megatron-core allocates buffers there), its RNG tracker keeps CPU
  generator states instead of forking CUDA ones, and ``transformer_engine`` is
  made unimportable so its local fallbacks are taken even where TE is present;
  the causal mask is passed in, as Megatron's own loop does (its default mask is
  built on "cuda");
* plain DeepSpeed: Hugging Face ``GPT2LMHeadModel`` built from a ``GPT2Config`` of
  the same shape (sdpa attention; no download), ``deepspeed.initialize``.  DeepSpeed
  has no tensor parallelism for training it, so it has no TP=2 row.

All use torch's fused AdamW (lr 1e-4) and clip at 1.0, fp32, no dropout, no
recomputation.  Per step: forward, backward, gradient sync (ours:
``finalize_model_grads``; DeepSpeed: its ``allreduce_gradients``, called on its
own), optimizer (``engine.step()``); each phase is the max over ranks, the
step its own max over ranks, medians over rounds.

Model FLOPs are megatron-core 0.16's count for every row (causal attention
counted once): ``72 B s L h^2 (1 + s/(12 h) + V/(12 h L))`` per step, B the
global batch.  "peak" is the share of that round's sgemm rate.

With memory on (default), each layout also trains one profiled step of ours
and prints each rank's peak tensor bytes (what lives before the step plus the
highest point the allocations reach inside it) next to ``ds-megatron plan``, and
the bus bytes the step put on the wire (counted on the package's collectives) next
to the plan's formula (``ds_megatron.planning.comm_volume``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_megatron.integration.local_job import run_local_job  # noqa: E402

SIZES = {  # name: (layers, hidden, heads)
    "h256": (4, 256, 8),  # 5.3M params with vocab 8192: the "as a user would" shape
    "h512": (4, 512, 8),  # 17M
    "h768": (8, 768, 12),  # 63M
    "h1024": (8, 1024, 16),  # 109M
}
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 2), "dp2": (2, 1)}  # name: (ranks, tp)
IMPLS = ("ours", "megatron-core", "deepspeed")
PHASES = ("forward", "backward", "grad sync", "optimizer")


def model_flops(batch, seq, layers, hidden, vocab):
    """megatron-core 0.16's model FLOPs of one step (forward + backward, causal attention counted once)."""
    return 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (12 * hidden) + vocab / (12 * hidden * layers))


# --------------------------------------------------------------------------------------------- megatron-core
def _patch_megatron_core_for_cpu():
    """The three places megatron-core 0.16 assumes CUDA on the paths this benchmark runs."""
    import torch
    sys.modules["transformer_engine"] = None  # local layer spec and fallbacks, even where TE is installed
    torch.cuda.current_device = lambda: "cpu"  # buffers megatron-core allocates on "the current device"
    from megatron.core.tensor_parallel import random as mrandom

    def add(self, name, seed):  # CudaRNGStatesTracker.add over the CPU generator
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)
    mrandom.CudaRNGStatesTracker.add = add
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


class _MegatronCoreMPU:
    """What DeepSpeed asks an mpu, answered from megatron-core's parallel_state."""

    def __init__(self):
        from megatron.core import parallel_state
        self.ps = parallel_state

    def get_model_parallel_group(self):
        return self.ps.get_model_parallel_group()

    def get_model_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(group=self.ps.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        import torch.distributed as dist
        return dist.get_world_size(group=self.ps.get_model_parallel_group())

    def get_tensor_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size

    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self):
        return self.ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self):
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_group_ranks(self):
        import torch.distributed as dist
        return dist.get_process_group_ranks(self.ps.get_data_parallel_group())


def _build_megatron_core(args, size, tp, optimizer):
    import deepspeed
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    layers, hidden, heads = size
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        # fusions are CUDA kernels: off, as megatron-core itself turns them off without TE / Apex
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    torch.manual_seed(1234)
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()),
                                      config=_ds_config(args), mpu=_MegatronCoreMPU())
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.mbs, args.seq)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)

    def forward(batch):
        return engine(batch["tokens"], positions, mask, labels=batch["labels"]).mean()
    return engine, forward


# --------------------------------------------------------------------------------------------- the others
def _ds_config(args):
    return {"train_micro_batch_size_per_gpu": args.mbs, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}


def _build_ours(args, size, tp, optimizer):
    import ds_megatron
    from ds_megatron.models import GPTConfig, GPTModel
    from ds_megatron.tensor_parallel import RNGStatesTracker, model_parallel_seed
    layers, hidden, heads = size
    cfg = {**_ds_config(args), "megatron": {"tensor_model_parallel_size": tp}}
    state = ds_megatron.initialize_model_parallel(cfg)
    tracker = model_parallel_seed(1234, state.tp.rank, tracker=RNGStatesTracker())
    gpt = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=args.seq,
                    vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(gpt, state, rng_tracker=tracker)
    engine, *_ = ds_megatron.initialize(model=model, optimizer=optimizer(model.parameters()), config=cfg,
                                        parallel_state=state)
    return engine, (lambda batch: engine(batch)), gpt, state


def _build_hf(args, size, optimizer):
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel
    layers, hidden, heads = size
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters()), config=_ds_config(args))

    def forward(batch):  # GPT-2 shifts the labels itself: the inputs are the labels
        return engine(input_ids=batch["tokens"], labels=batch["tokens"]).loss
    return engine, forward


# --------------------------------------------------------------------------------------------- timing
def _timed_step(kind, engine, forward, batch):
    import time as _time
    t0 = _time.perf_counter()
    loss = forward(batch)
    t1 = _time.perf_counter()
    engine.backward(loss)
    t2 = _time.perf_counter()
    if kind == "ours":
        engine.megatron.finalize_model_grads()
    else:
        engine.allreduce_gradients()
    t3 = _time.perf_counter()
    engine.step()
    t4 = _time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0]


def _sgemm_rate(threads):
    """FLOP/s of this rank's 1024^3 sgemm (best of three)."""
    import torch
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024 ** 3 / best


def _memory_step(engine, forward, batch):
    """The highest point this rank's allocations reach inside one step (over what lives before it), plus the
    output layer's logits buffer, which lives from step to step."""
    from ds_megatron.utils.memory import peak_allocated_bytes

    def step():
        engine.backward(forward(batch))
        engine.step()
    kept = engine.module.logits_buffer._tensor  # kept from step to step: activation memory all the same
    return peak_allocated_bytes(step)[0] + (kept.numel() * kept.element_size() if kept is not None else 0)


def _static_bytes(engine):
    """Params, gradient buffers, fp32 main params and optimizer state this rank holds (measured on the tensors)."""
    ddp = engine.megatron.ddp
    seen, total = set(), 0
    tensors = list(engine.module.parameters()) + [b.grad_data for b in ddp.all_buffers]
    tensors += engine.optimizer.main_param_tensors()
    tensors += [v for s in engine.optimizer.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _job(args, layout_name):
    import torch
    import torch.distributed as dist
    _patch_megatron_core_for_cpu()
    from ds_megatron.integration.runtime import set_deepspeed_log_level
    from ds_megatron.planning.comm_volume import plan_comm_volume
    from ds_megatron.planning import plan_memory
    from ds_megatron.utils.collectives import count_bytes
    set_deepspeed_log_level("ERROR")
    world, tp = LAYOUTS[layout_name]
    dp = world // tp
    threads = torch.get_num_threads()

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-4, fused=True)

    out = []
    for size_name in args.sizes:
        size = SIZES[size_name]
        impls = {}
        engine, forward, gpt, state = _build_ours(args, size, tp, optimizer)
        impls["ours"] = (engine, forward)
        if not args.ours_only:
            impls["megatron-core"] = _build_megatron_core(args, size, tp, optimizer)
            if tp == 1:
                impls["deepspeed"] = _build_hf(args, size, optimizer)
        for kind, (engine, _) in impls.items():
            if kind != "ours":
                engine.enable_backward_allreduce = False  # its all-reduce is timed on its own (allreduce_gradients)
        params = {kind: sum(p.numel() for p in e.module.parameters()) for kind, (e, _) in impls.items()}
        g = torch.Generator().manual_seed(100 + dist.get_rank() // tp)
        names = list(impls)
        times = {kind: [] for kind in names}
        peaks = []
        for rnd in range(args.warmup + args.rounds):
            tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=g)
            batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for kind in order:
                engine, forward = impls[kind]
                dist.barrier()
                phases = torch.tensor(_timed_step(kind, engine, forward, batch), dtype=torch.float64)
                dist.all_reduce(phases, op=dist.ReduceOp.MAX)
                if rnd >= args.warmup:
                    times[kind].append(phases.tolist())
            dist.barrier()
            rate = torch.tensor([_sgemm_rate(threads)], dtype=torch.float64)
            dist.all_reduce(rate)  # the ranks share the machine: their rates add up
            if rnd >= args.warmup:
                peaks.append(float(rate))
        flops = model_flops(args.mbs * dp, args.seq, size[0], size[1], args.vocab)
        tokens_per_step = args.mbs * dp * args.seq
        row = {"size": size_name, "layout": layout_name, "params": params, "rows": {}}
        for kind in names:
            steps = [t[4] for t in times[kind]]
            row["rows"][kind] = {
                "step_s": statistics.median(steps),
                "phases_s": [statistics.median(t[i] for t in times[kind]) for i in range(4)],
                "tokens_per_s": tokens_per_step / statistics.median(steps),
                "flops_per_s": flops / statistics.median(steps),
                "peak_share": statistics.median(flops / s / p for s, p in zip(steps, peaks)),
            }
        row["peak_flops_per_s"] = statistics.median(peaks)
        if args.memory:
            engine, forward = impls["ours"]
            tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=g)
            batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
            static = _static_bytes(engine)
            with count_bytes() as counter:
                transient = _memory_step(engine, forward, batch)
            plan = next(p for p in plan_memory(gpt, state.layout, "fp32", "adamw", micro_batch=args.mbs)
                        if dist.get_rank() in p.ranks)
            comm, = plan_comm_volume(gpt, state.layout, "fp32", micro_batch=args.mbs)
            mine = torch.tensor([static, transient, static + transient, plan.total_bytes,
                                 plan.total_bytes - plan.activation_bytes, plan.activation_bytes,
                                 counter.bus_bytes(), comm.total], dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            row["memory"] = [dict(zip(("static", "transient_peak", "peak", "plan_total", "plan_static",
                                       "plan_activations", "bus_bytes", "plan_bus_bytes"), t.tolist()))
                             for t in every]
        out.append(row)
        for kind, (engine, _) in impls.items():
            if kind == "ours" and engine.megatron.ddp_in_engine is not None:
                engine.megatron.ddp_in_engine.detach()
        state.destroy()
        del impls
    return out


# --------------------------------------------------------------------------------------------- the table
def _print(rows, args):
    print(f"\nGPT, seq {args.seq}, micro-batch {args.mbs}, vocab {args.vocab}, fp32, AdamW (fused), no dropout; "
          f"{args.threads} threads in all per row; median of {args.rounds} rounds; model FLOPs "
          "72*B*s*L*h^2*(1 + s/(12h) + V/(12hL)); peak: same-round 1024^3 sgemm")
    head = (f"{'size':6s} {'layout':6s} {'impl':14s} {'params':>7s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'peak':>6s} "
            f"{'ours/mcore':>10s} {'ours/DS':>8s}   {'fwd':>6s} {'bwd':>6s} {'sync':>6s} {'opt':>6s}  ms")
    print(head)
    for row in rows:
        ours = row["rows"]["ours"]["tokens_per_s"]
        for kind, r in row["rows"].items():
            vs_mc = f"{ours / row['rows']['megatron-core']['tokens_per_s']:.2f}x" \
                if kind == "ours" and "megatron-core" in row["rows"] else ""
            vs_ds = f"{ours / row['rows']['deepspeed']['tokens_per_s']:.2f}x" \
                if kind == "ours" and "deepspeed" in row["rows"] else ""
            ph = " ".join(f"{p * 1e3:6.1f}" for p in r["phases_s"])
            print(f"{row['size']:6s} {row['layout']:6s} {kind:14s} {row['params'][kind] / 1e6:6.1f}M "
                  f"{r['tokens_per_s']:9,.0f} {r['flops_per_s'] / 1e9:8.1f} {r['peak_share'] * 100:5.1f}% "
                  f"{vs_mc:>10s} {vs_ds:>8s}   {ph}")
        if row["layout"] == "tp2" and "megatron-core" in row["rows"]:
            print(f"{row['size']:6s} {row['layout']:6s} {'deepspeed':14s}    (plain DeepSpeed has no tensor "
                  "parallelism for training this model)")
        print(f"{'':14s} peak (sgemm, same rounds): {row['peak_flops_per_s'] / 1e9:.1f} GFLOP/s")
    if any("memory" in row for row in rows):
        print("\nours, peak tensor bytes per rank (measured: alive before the step + highest point inside it) "
              "vs ds-megatron plan")
        print(f"{'size':6s} {'layout':6s} {'rank':>4s} {'static MiB':>11s} {'plan':>8s} {'step peak':>10s} "
              f"{'plan act.':>10s} {'total MiB':>10s} {'plan':>8s} {'plan/measured':>13s} {'bus MB/step':>12s} "
              f"{'plan':>8s}")
        for row in rows:
            for rank, m in enumerate(row.get("memory", [])):
                mib = 2 ** 20
                print(f"{row['size']:6s} {row['layout']:6s} {rank:4d} {m['static'] / mib:11.1f} "
                      f"{m['plan_static'] / mib:8.1f} {m['transient_peak'] / mib:10.1f} "
                      f"{m['plan_activations'] / mib:10.1f} {m['peak'] / mib:10.1f} {m['plan_total'] / mib:8.1f} "
                      f"{m['plan_total'] / m['peak']:12.2f}x {m['bus_bytes'] / 1e6:12.2f} "
                      f"{m['plan_bus_bytes'] / 1e6:8.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="h256,h512", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--layouts", default="tp1,tp2,dp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads in all (split over ranks)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    ap.add_argument("--ours-only", action="store_true", help="skip megatron-core and DeepSpeed (profiling ours)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    args.sizes = args.sizes.split(",")
    for name in args.sizes:
        if name not in SIZES:
            ap.error(f"--sizes: {name!r} is not one of {', '.join(SIZES)}")
    rows = []
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            ap.error(f"--layouts: {layout!r} is not one of {', '.join(LAYOUTS)}")
        world = LAYOUTS[layout][0]
        rows += run_local_job(world, _job, args, layout, threads_per_rank=max(1, args.threads // world),
                              timeout=3600)
    _print(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
