"""Training metrics: a JSONL log that strict JSON readers accept, the progress-line text, and the loss-curve plot."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional

METRICS = "metrics.jsonl"  # in the job's output directory


def strict_json_record(record: Dict[str, Any]) -> Dict[str, Any]:
    """``record`` with every non-finite float replaced by null and named under ``"nonfinite"``.

    ``json.dumps`` would write ``Infinity`` / ``NaN``, which no strict JSON parser accepts.
    """
    out: Dict[str, Any] = {}
    nonfinite: Dict[str, str] = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            nonfinite[key] = repr(value)  # "inf", "-inf", "nan"
        else:
            out[key] = value
    if nonfinite:
        out["nonfinite"] = nonfinite
    return out


def start_fresh_metrics(out_dir: str) -> Optional[str]:
    """A run that starts at step 0 gets an empty ``metrics.jsonl``: an older one is renamed to
    ``metrics.jsonl.N`` (the first free N), never appended to.  Returns the new name of the old file."""
    path = os.path.join(out_dir, METRICS)
    if not os.path.exists(path):
        return None
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def rewind_metrics(out_dir: str, step: int) -> int:
    """A run resumed at ``step`` continues ``metrics.jsonl`` from there: records of later steps (logged by the run
    that was lost before it saved again; the resumed run trains those steps anew) move, in order, to
    ``metrics.jsonl.after-<step>`` (the first free name), so every step is in the file once.  Returns how many moved."""
    path = os.path.join(out_dir, METRICS)
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    steps = [json.loads(line).get("step", 0) for line in lines]
    keep = [line for line, s in zip(lines, steps) if s <= step]
    later = [line for line, s in zip(lines, steps) if s > step]
    if not later:
        return 0
    side, n = f"{path}.after-{step}", 1
    while os.path.exists(side):
        side, n = f"{path}.after-{step}.{n}", n + 1
    with open(side, "w") as f:
        f.writelines(later)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
    return len(later)


class MetricsLog:
    """Appends one strict-JSON object per line; ``--resume`` continues the file of the run it resumes."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: Dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_json_record(record), allow_nan=False) + "\n")

    def read(self) -> List[Dict[str, Any]]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def format_duration(seconds: float) -> str:
    """``2h05m``, ``4m12s``, ``9s``."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_bytes(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def progress_text(step: int, loss: float, lr: float, tokens_per_s: float, grad_norm: Optional[float],
                  loss_scale: Optional[float] = None, eta_s: Optional[float] = None,
                  peak_memory: Optional[int] = None) -> str:
    """One log line's fields: loss, lr, tokens/s, grad norm, loss scale (when scaling), peak memory, ETA."""
    parts = [f"loss {loss:.4f}", f"lr {lr:.2e}", f"{tokens_per_s:,.0f} tok/s"]
    if grad_norm is not None:
        parts.append(f"gnorm {grad_norm:.3f}")
    if loss_scale is not None:
        parts.append(f"scale {loss_scale:g}")
    if peak_memory is not None:
        parts.append(f"peak mem {format_bytes(peak_memory)}")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def plot_loss_curve(records: List[Dict[str, Any]], path: str) -> Optional[str]:
    """Train and validation loss against step, as a PNG; None (with the reason) if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'ds-megatron[plot]'); no plot written"
    # A resumed run appends again from its checkpoint step: keep the last record per step.
    train = {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
    valid = {r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None}
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(train), [train[s] for s in sorted(train)], label="train loss", lw=1)
    if valid:
        ax.plot(sorted(valid), [valid[s] for s in sorted(valid)], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
