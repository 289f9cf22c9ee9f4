"""Plot tool-call rate, reward and validation accuracy per GRPO step; print start -> end.

Used by the tool-arith recipes:  python examples/plot_tool_arith.py RUN/grpo TITLE OUT.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from postrl.tracking.plots import read_metrics

run, title, out_name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = read_metrics(run)


def series(*keys):
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key]]
        if pts:
            return key, [p[0] for p in pts], [p[1] for p in pts]
    return keys[0], [], []


curves = [
    series("agent/num_tool_calls/mean", "agent/num_tool_calls"),
    series("critic/score/mean"),
    series("val/acc/mean"),
]
fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
for (key, xs, ys), label in zip(
    curves, ("tool calls per trajectory (train)", "reward (train)", "validation accuracy (greedy)")
):
    if xs:
        ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, ms=3, label=label)
        sys.stdout.write(f"{key}: {ys[0]:.3f} -> {ys[-1]:.3f} (steps {xs[0]:g}..{xs[-1]:g})\n")
ax.set_xlabel("GRPO step")
ax.set_ylim(-0.02, 1.02)
ax.set_title(title)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(run / out_name)
sys.stdout.write(f"plot: {run / out_name}\n")
