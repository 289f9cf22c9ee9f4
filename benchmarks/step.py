"""One RL step of the reference workload W1, postrl vs plain transformers, measured side by side.

Same as ``postrl bench step``; see ``postrl/bench/step.py`` and ``docs/benchmarks.md``.

    python benchmarks/step.py [--steps 5] [--work-dir runs/bench_step] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import sys

from postrl.bench.step import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
