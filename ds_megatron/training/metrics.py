"""Training metrics: a JSONL log, the rank-0 progress bar text, and the loss-curve plot."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional


class MetricsLog:
    """Appends one JSON object per line; the file survives restarts (``--resume`` continues it)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: Dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> List[Dict[str, Any]]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def progress_text(step: int, loss: float, lr: float, tokens_per_s: float, grad_norm: Optional[float],
                  loss_scale: Optional[float] = None) -> str:
    parts = [f"loss {loss:.4f}", f"lr {lr:.2e}", f"{tokens_per_s:,.0f} tok/s"]
    if grad_norm is not None:
        parts.append(f"gnorm {grad_norm:.3f}")
    if loss_scale is not None:
        parts.append(f"scale {loss_scale:g}")
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
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    valid = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
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
