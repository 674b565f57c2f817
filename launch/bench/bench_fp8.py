"""FP8 against bf16: the same job trained with bf16 GEMMs and with each fp8 recipe, side by side.

    python launch/bench/bench_fp8.py [--config ds_configs/gpt_bf16_tp2_dp2.json] [--steps 300]
        [--variants bf16,tensorwise,delayed,blockwise,hybrid,param_gather] [--hidden H] [--layers L] [--seq S]
        [--launcher "bash launch/deepspeed_cpu.sh 4"] [--out /tmp/bench_fp8]

Each variant is one ``ds-megatron train`` of ``--config`` (bf16 on, the main job's model and layout by default:
TP 2 x DP 2) for ``--steps`` steps through ``--launcher``, its ``model.fp8`` / ``fp8_recipe`` set per variant
(``param_gather``: tensorwise with ``fp8_param_gather`` and the distributed optimizer).  From each run's
``metrics.jsonl``: the last validation loss and the mean training loss of the last 10 logged steps, each against
bf16's, and tokens/s (the mean of the logged steps after the first 10%) against bf16's.  A variant the layout
cannot run (blockwise needs every rank's widths to tile by 128) is reported with the config's one-line refusal.

On a CPU the fp8 GEMMs are emulated (``torch._scaled_mm`` on this build, or the exact fp32 emulation for
blockwise), so tokens/s there says nothing of fp8's speed: the loss columns are the point.  On a GPU (issue 42's
goal: at least 1.3x bf16's tokens/s at hidden 4096, 8 layers, seq 4096, loss within 1%) pass
``--launcher "deepspeed --num_gpus N"`` and the shape flags.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ds_megatron.config import split_config  # noqa: E402  (after the path set-up above)
from ds_megatron.errors import ConfigError  # noqa: E402

VARIANTS = {  # name: (model.fp8, fp8_recipe, fp8_param_gather)
    "bf16": (None, None, False),
    "tensorwise": ("e4m3", "tensorwise", False),
    "delayed": ("e4m3", "delayed", False),
    "blockwise": ("e4m3", "blockwise", False),
    "hybrid": ("hybrid", "tensorwise", False),
    "param_gather": ("e4m3", "tensorwise", True),
}


def job_config(base: dict, name: str, args, out: str) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["bf16"] = {"enabled": True}
    m = cfg["megatron"]
    fp8, recipe, gather = VARIANTS[name]
    model = m["model"]
    for key, value in (("hidden_size", args.hidden), ("num_layers", args.layers), ("seq_length", args.seq)):
        if value:
            model[key] = value
    model.pop("fp8", None)
    if fp8 is not None:
        model.update(fp8=fp8, fp8_recipe=recipe)
        if recipe == "delayed":
            model.update(fp8_amax_history_len=16, fp8_amax_compute_algo="max")  # Megatron's usual delayed setting
    if gather:
        m.update(use_distributed_optimizer=True, fp8_param_gather=True)
    steps = args.steps
    m["train"].update(train_iters=steps, log_interval=max(1, steps // 50), eval_interval=steps,
                      save_interval=10 ** 9, output_dir=os.path.join(out, name))
    return cfg


def refusal(cfg: dict, world: int) -> str:
    try:
        split_config(cfg)[1].layout(world)
    except ConfigError as e:
        return str(e)
    return ""


def run(cfg: dict, name: str, args, out: str) -> dict:
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        subprocess.run(shlex.split(args.launcher) + ["-m", "ds_megatron.cli", "train", "--config", path],
                       env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r.get("loss") is not None]
    rates = [r["tokens_per_s"] for r in train[len(train) // 10:] if r.get("tokens_per_s")]
    return {"val_loss": [r["val_loss"] for r in records if r.get("val_loss") is not None][-1],
            "loss": statistics.mean(r["loss"] for r in train[-10:]),
            "tokens_per_s": statistics.mean(rates) if rates else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "ds_configs", "gpt_bf16_tp2_dp2.json"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hidden", type=int), p.add_argument("--layers", type=int), p.add_argument("--seq", type=int)
    p.add_argument("--launcher", default="bash launch/deepspeed_cpu.sh 4")
    p.add_argument("--world", type=int, default=4, help="the launcher's ranks (to check each variant's config)")
    p.add_argument("--out", default="/tmp/bench_fp8")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(args.config) as f:
        base = json.load(f)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "bf16" not in names:
        p.error(f"--variants: {unknown or 'bf16 missing'}; choose among {', '.join(VARIANTS)}, bf16 included")
    results = {}
    for name in names:
        cfg = job_config(base, name, args, args.out)
        why = refusal(cfg, args.world)
        results[name] = why or run(cfg, name, args, args.out)
        print(f"{name}: {results[name]}", flush=True)
    ref = results["bf16"]
    print(f"\n{args.steps} steps of {os.path.relpath(args.config, ROOT)} (bf16 params, fp32 main params)")
    print(f"{'variant':<13} {'val loss':>9} {'vs bf16':>8} {'loss (last 10)':>15} {'vs bf16':>8} "
          f"{'tokens/s':>10} {'vs bf16':>8}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:<13} refused: {r}")
            continue
        print(f"{name:<13} {r['val_loss']:>9.4f} {r['val_loss'] / ref['val_loss'] - 1:>+8.2%} {r['loss']:>15.4f} "
              f"{r['loss'] / ref['loss'] - 1:>+8.2%} {r['tokens_per_s']:>10,.0f} "
              f"{r['tokens_per_s'] / ref['tokens_per_s']:>7.2f}x")


if __name__ == "__main__":
    main()
