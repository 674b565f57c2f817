"""``fp8_param_gather`` on the main job's model: the parameter all-gather's bytes per step and the loss gap.

    python launch/bench/bench_fp8_param_gather.py [--steps 100] [--out /tmp/fp8_param_gather] [--layout tp2]

The main job (``ds_configs/gpt_cpu_tp2_dp2.json``: TP=2 x DP=2) in bf16 with ``model.fp8 "e4m3"``,
``fp8_recipe "tensorwise"`` and the distributed optimizer, with and without ``fp8_param_gather``:

* bytes: one step of each on four local ranks inside ``count_bytes()`` (the second step: the first's all-gather is
  the same), the all-gathers over dp-cp by dtype (payload per rank and nccl-tests bus bytes);
* loss: ``ds-megatron train`` of each for ``--steps`` steps (``launch/deepspeed_cpu.sh 4``), every step's training
  loss from ``metrics.jsonl``, and the largest difference between the two runs.  The fp8 bytes and scales are those
  the layer makes from its bf16 weight (``ds_megatron/fp8/param.py``), but the fp8 weights' own buffer moves the
  DP shards, so the gradient norm is summed in another order: with clipping (the main job's 1.0) the runs part by
  rounding; ``--gradient-clipping 0`` shows them equal.

``--layout`` runs the training comparison at another layout of the same four ranks and global batch (16
sequences a step): ``pp2`` (PP 2 x DP 2, ZB-H1, 2 micro-batches of 4), ``cp2`` (CP 2 x DP 2), ``ep2`` (4 experts,
top-2, at EP 2 x DP 4, micro-batches of 4); the bytes are counted for the main layout only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ds_megatron.integration.local_job import run_local_job  # noqa: E402


# the main job's TP 2 x DP 2 turned into another layout of its 4 ranks: (megatron keys, model keys, ds keys)
LAYOUTS = {
    "tp2": ({}, {}, {}),
    "pp2": (dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, pipeline_schedule="zero_bubble"), {},
            dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)),
    "cp2": (dict(tensor_model_parallel_size=1, context_parallel_size=2), {}, {}),
    "ep2": (dict(tensor_model_parallel_size=1, expert_model_parallel_size=2), dict(num_experts=4, moe_router_topk=2),
            dict(train_micro_batch_size_per_gpu=4)),
}


def job_config(gather: bool, steps: int, out: str, clip: float = 1.0, layout: str = "tp2") -> dict:
    with open(os.path.join(ROOT, "ds_configs", "gpt_cpu_tp2_dp2.json")) as f:
        cfg = json.load(f)
    cfg["gradient_clipping"] = clip
    cfg["bf16"] = {"enabled": True}
    m = cfg["megatron"]
    megatron, model, ds = LAYOUTS[layout]
    cfg.update(ds)
    m.update(megatron, use_distributed_optimizer=True, fp8_param_gather=gather)
    m["model"].update(model, fp8="e4m3", fp8_recipe="tensorwise")
    m["train"].update(train_iters=steps, log_interval=1, eval_interval=steps, save_interval=10 ** 9,
                      output_dir=os.path.join(out, f"gather_{int(gather)}"))
    return cfg


def _count(gather: bool) -> dict:
    import torch

    import ds_megatron
    from ds_megatron.config import GPTConfig
    from ds_megatron.models.gpt import GPTModel
    from ds_megatron.utils.collectives import count_bytes
    cfg = job_config(gather, 2, "/tmp")
    model_section = cfg["megatron"].pop("model")
    cfg["megatron"].pop("train"), cfg["megatron"].pop("data")
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}  # ds-megatron train's default optimizer
    state = ds_megatron.initialize_model_parallel(cfg)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**model_section), state)
    engine, *_ = ds_megatron.initialize(model=model, config=cfg, parallel_state=state)
    mb, seq, vocab = cfg["train_micro_batch_size_per_gpu"], model_section["seq_length"], model_section["vocab_size"]
    for _ in range(2):
        tokens = torch.randint(0, vocab, (mb, seq + 1))
        with count_bytes() as counter:
            engine.backward(engine({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}))
            engine.step()
    out = {"payload_bytes": sum(r.payload_bytes for r in counter.records if r.op == "all_gather"),
           "bus_bytes": sum(r.bus_bytes for r in counter.records if r.op == "all_gather"),
           "calls": [(r.payload_bytes, r.bus_bytes) for r in counter.records if r.op == "all_gather"]}
    engine.megatron.destroy()
    return out


def train(gather: bool, steps: int, out: str, clip: float, layout: str) -> list:
    path = os.path.join(out, f"gather_{int(gather)}.json")
    with open(path, "w") as f:
        json.dump(job_config(gather, steps, out, clip, layout), f)
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu")
    log = os.path.join(out, f"gather_{int(gather)}.log")
    with open(log, "w") as f:
        subprocess.run(["bash", os.path.join(ROOT, "launch", "deepspeed_cpu.sh"), "4", "-m", "ds_megatron.cli",
                        "train", "--config", path], env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(out, f"gather_{int(gather)}", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="/tmp/fp8_param_gather")
    p.add_argument("--gradient-clipping", type=float, default=1.0, help="the main job's 1.0; 0: no clipping")
    p.add_argument("--no-bytes", action="store_true", help="only the training runs")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2",
                   help="the training runs' layout (see above); the bytes are counted at tp2 only")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for gather in () if args.no_bytes or args.layout != "tp2" else (False, True):
        c = run_local_job(4, _count, gather)
        print(f"fp8_param_gather={gather}: param all-gather per step per rank: {c['payload_bytes']:,} bytes "
              f"(bus {c['bus_bytes']:,.0f}); calls (payload, bus): {c['calls']}", flush=True)
    losses = {gather: train(gather, args.steps, args.out, args.gradient_clipping, args.layout)
              for gather in (False, True)}
    gaps = [abs(a - b) for (_, a), (_, b) in zip(losses[False], losses[True])]
    print(f"{len(gaps)} steps; loss at the last step: off {losses[False][-1][1]:.6f}, on {losses[True][-1][1]:.6f}; "
          f"largest gap {max(gaps):.3g}; steps with a gap: {sum(g > 0 for g in gaps)}")


if __name__ == "__main__":
    main()
