"""End-of-run plots (``RUN_DIR/plots/*.png``) and a short text summary from ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["PLOTS", "make_plots", "summarize", "read_metrics"]

#: file name -> (title, metric keys drawn on it)
PLOTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("reward", ("critic/score/mean", "critic/rewards/mean")),
    "accuracy": ("validation accuracy", ("val/acc/mean",)),
    "kl": ("KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    "entropy": ("entropy", ("actor/entropy",)),
    "response_length": ("response length", ("response_length/mean",)),
}


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """Rows of ``RUN_DIR/metrics.jsonl`` (nulls as NaN)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for ln in path.read_text().splitlines():
        if ln.strip():
            rows.append({k: (math.nan if v is None else v) for k, v in json.loads(ln).items()})
    return rows


def _series(rows: list[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and not math.isnan(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def make_plots(run_dir: str | Path) -> list[Path]:
    """Draw one PNG per entry of :data:`PLOTS` that has data; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    val_keys = sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/acc")})
    for name, (title, keys) in PLOTS.items():
        keys = keys + tuple(val_keys) if name == "accuracy" else keys
        series = [(k, *_series(rows, k)) for k in keys]
        series = [s for s in series if s[1]]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=110)
        for k, xs, ys in series:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=k)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def summarize(run_dir: str | Path) -> str:
    """A few lines: steps, first→last score and validation accuracy, time per step."""
    rows = read_metrics(run_dir)
    if not rows:
        return "no metrics recorded"
    lines = [f"steps: {int(rows[-1]['step'])}"]
    for key in (
        "critic/score/mean",
        "val/acc/mean",
        "response_length/mean",
        "timing_s/step",
        "perf/throughput",
    ):
        xs, ys = _series(rows, key)
        if ys:
            lines.append(f"{key}: first {ys[0]:.4g} → last {ys[-1]:.4g} (best {max(ys):.4g})")
    return "\n".join(lines)
