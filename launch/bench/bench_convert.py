"""Peak memory of ``ds-megatron convert`` on a Llama of a few hundred MB, against its largest tensor and its size.

    python launch/bench/bench_convert.py [--hidden 1024] [--layers 6] [--vocab 32000] [--keep DIR]

Writes a random Llama checkpoint tensor by tensor (never the whole model in memory), then runs the import
(TP=2 x PP=2) and the export in fresh processes, each reporting its RSS after imports and its peak RSS
(``VmHWM``).  The converter should add about one tensor (plus its slices) to the baseline, not the model.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM; unlike ru_maxrss, not inherited
    from the parent across fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_checkpoint(directory: str, hidden: int, layers: int, vocab: int) -> dict:
    import torch
    from ds_megatron.config.hf_config import model_from_hf
    from ds_megatron.convert.mapping import Layout, Mapping
    from ds_megatron.convert.safetensors_io import StreamingWriter
    from ds_megatron.models import GPTConfig
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
          "intermediate_size": int(hidden * 2.75) // 64 * 64, "num_hidden_layers": layers,
          "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 256, "vocab_size": vocab,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "float32"}
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)
    family, model = model_from_hf(hf)
    shapes = Mapping(family, GPTConfig(**model), Layout.uniform(layers)).hf_shapes()
    writer = StreamingWriter(os.path.join(directory, "model.safetensors"),
                             [(n, torch.float32, s) for n, s in sorted(shapes.items())], {"format": "pt"})
    g = torch.Generator().manual_seed(0)
    for name, shape in sorted(shapes.items()):
        writer.write(name, torch.randn(shape, generator=g) * 0.02)
    writer.close()
    sizes = [torch.Size(s).numel() * 4 for s in shapes.values()]
    return {"model_mib": sum(sizes) / 2 ** 20, "largest_mib": max(sizes) / 2 ** 20, "tensors": len(sizes)}


def child(direction: str, src: str, dst: str) -> None:
    from ds_megatron.convert.checkpoint import hf_to_ours, ours_to_hf
    base = rss_mib()
    t = time.perf_counter()
    if direction == "import":
        hf_to_ours(src, dst, tp=2, pp=2)
    else:
        ours_to_hf(src, dst)
    seconds = time.perf_counter() - t
    peak = rss_mib("VmHWM")
    print(json.dumps({"baseline_mib": base, "peak_mib": peak, "seconds": seconds}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--keep", help="work in this directory and keep it")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    work = args.keep or tempfile.mkdtemp(prefix="bench_convert_")
    try:
        info = make_checkpoint(os.path.join(work, "hf"), args.hidden, args.layers, args.vocab)
        print(f"Llama h={args.hidden} layers={args.layers} vocab={args.vocab}: {info['tensors']} tensors, "
              f"{info['model_mib']:.0f} MiB fp32, largest tensor {info['largest_mib']:.0f} MiB")
        print(f"{'direction':<22} {'RSS after imports':>18} {'peak RSS':>10} {'peak - base':>12} {'seconds':>8}")
        for direction, src, dst in (("import (TP=2 x PP=2)", "hf", "ours"), ("export", "ours", "back")):
            out = subprocess.run([sys.executable, __file__, "--child", direction.split()[0],
                                  os.path.join(work, src), os.path.join(work, dst)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{direction:<22} {r['baseline_mib']:>14.0f} MiB {r['peak_mib']:>6.0f} MiB "
                  f"{r['peak_mib'] - r['baseline_mib']:>8.0f} MiB {r['seconds']:>8.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
