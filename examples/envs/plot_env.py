"""Plot an environment run's training success, return and greedy validation success per step.

Used by the environment recipes:  python examples/envs/plot_env.py RUN/grpo TITLE OUT.png
Prints each curve's start -> end and the validation table (step, success) for docs/agent.md.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from postrl.tracking.plots import read_metrics

run, title, out_name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = read_metrics(run)


def series(key):
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key]]
    return [p[0] for p in pts], [p[1] for p in pts]


curves = [
    ("agent/env/success", "success (train episodes)"),
    ("critic/score/mean", "return (train)"),
    ("val/acc/mean", "success (validation, greedy)"),
]
fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
for key, label in curves:
    xs, ys = series(key)
    if xs:
        ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, ms=3, label=label)
        sys.stdout.write(f"{key}: {ys[0]:.3f} -> {ys[-1]:.3f} (steps {xs[0]:g}..{xs[-1]:g})\n")
sys.stdout.write("| step | validation success | train success (that step) |\n|---|---|---|\n")
train = dict(zip(*series("agent/env/success")))
for x, y in zip(*series("val/acc/mean")):
    t = train.get(x)
    sys.stdout.write(f"| {x:g} | {y:.3f} | {'' if t is None else f'{t:.3f}'} |\n")
ax.set_xlabel("GRPO step")
ax.set_ylim(-0.02, 1.02)
ax.set_title(title)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(run / out_name)
sys.stdout.write(f"plot: {run / out_name}\n")
