"""Repeat the fault and concurrency tests under competing CPU load: ``make test-stress``.

A gate that is green only on a quiet machine lands nothing on a busy one. This script starts
``--load`` busy loops (``nice`` 10 by default, as another user's job would be: they take the
cycles the tests leave, and more with ``--nice 0``), then runs the tests marked ``fault``
(kills, hangs, restarts, weight pushes, resumes; the marker is given in ``tests/conftest.py``)
``--runs`` times, and prints one line per run and a summary::

    python tests/stress.py --runs 3 --load 1            # what `make test-stress` runs
    python tests/stress.py --runs 5 --load 2 --nice 0 -k replica

Extra arguments after the options go to pytest. The exit code is 1 when any run failed; each
run's output is kept in ``runs/stress/run_<i>.log``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

BUSY = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    """Run the stress loop; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="how many times to run the tests")
    p.add_argument("--load", type=int, default=1, help="busy-loop processes competing")
    p.add_argument("--nice", type=int, default=10, help="niceness of the busy loops")
    p.add_argument("--out", default="runs/stress", help="where each run's log goes")
    args, pytest_args = p.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hogs = [
        subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lambda: os.nice(args.nice))
        for _ in range(args.load)
    ]
    results: list[tuple[int, int, float]] = []
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            log = out / f"run_{i}.log"
            with open(log, "w") as f:
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                rc = subprocess.call([*cmd, "-m", "fault", *pytest_args], stdout=f, stderr=f)
            took = time.monotonic() - t0
            results.append((i, rc, took))
            tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
            print(f"run {i}/{args.runs}: rc={rc} {took:.0f}s  {tail[0]}", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    bad = [i for i, rc, _ in results if rc != 0]
    total = sum(t for _, _, t in results)
    print(
        f"stress: {len(results) - len(bad)} of {len(results)} runs passed under {args.load} "
        f"busy loop(s) at nice {args.nice}, {total:.0f}s in all"
        + (f"; failed runs: {bad} (logs in {out})" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
