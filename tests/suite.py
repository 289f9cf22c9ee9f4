"""The whole suite in two phases: what `make test` (and so `.ci/run`) runs.

Measured on the 2-core AVX2 kind, one plain pytest process keeps ~0.8 of the two cores busy:
most tests are tiny models whose time is Python, process starts, sleeps on purpose (hangs,
deadlines) and HTTP round trips, not BLAS. So:

1. every test that is not marked ``serial`` runs on ``--workers`` pytest-xdist workers, whole
   files to one worker (``--dist loadfile``: module-scoped fixtures are built once, and tests
   that build on the ones before them in their file keep their order), the longest files first
   (``tests/conftest.py``'s :data:`SLOW_FIRST`, ``--no-loadscope-reorder``). The fault tests
   (kills, hangs, restarts, weight pushes) run here too: they wait on events with deadlines that
   hold next to a busy neighbour, which ``make test-stress`` proves by repeating them under load;
2. the tests marked ``serial`` by hand, alone, in one process (none today: the phase is skipped
   when neither a marker in :data:`SERIAL_MARKERS` nor a test file asks for it).

The exit code is the first non-zero one of the two phases (pytest's "no tests collected" counts
as success, so ``make test PYTEST_ARGS=tests/algos`` works)::

    python tests/suite.py                      # what `make test` runs
    python tests/suite.py --workers 1 -x       # one process, stop at the first failure
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

NO_TESTS = 5  # pytest's exit code when a phase selects nothing


def _may_have_serial_tests() -> bool:
    """Whether phase 2 can select anything: ``tests/conftest.py`` turns some markers into
    ``serial`` (:data:`SERIAL_MARKERS`), or a test file marks a test ``serial`` by hand."""
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("_suite_conftest", here / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    if conftest.SERIAL_MARKERS:
        return True
    return any("mark.serial" in f.read_text() for f in here.rglob("test_*.py"))


def main(argv: list[str] | None = None) -> int:
    """Run both phases; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("POSTRL_TEST_WORKERS", "2")),
        help="pytest-xdist workers for phase 1 (1 = no xdist); default POSTRL_TEST_WORKERS or 2",
    )
    args, pytest_args = p.parse_known_args(argv)
    base = [sys.executable, "-m", "pytest", "-q"]
    par = (
        ["-n", str(args.workers), "--dist", "loadfile", "--no-loadscope-reorder"]
        if args.workers > 1
        else []
    )
    phases = [("parallel", [*base, *par, "-m", "not serial", *pytest_args])]
    serial = _may_have_serial_tests()  # else: collecting 1,000+ tests to select none costs ~15 s
    if serial:
        phases.append(("serial", [*base, "-m", "serial", *pytest_args]))
    # sleeping, not spinning, OpenMP waits for every process the tests start (tests/conftest.py)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rcs = []
    for name, cmd in phases:
        t0 = time.monotonic()
        print(f"== phase {name}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        rc = 0 if rc == NO_TESTS else rc
        print(f"== phase {name}: rc={rc} in {time.monotonic() - t0:.0f}s", flush=True)
        rcs.append(rc)
    if not serial:
        print("== phase serial: skipped (no marker in SERIAL_MARKERS, no test marked serial)")
    return next((rc for rc in rcs if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
