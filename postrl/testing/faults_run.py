"""``python -m postrl.testing.faults_run --kill-at POINT <postrl command ...>``: crash on purpose
(or ``--corrupt-sync STEP`` / ``--corrupt-sync-always STEP``: corrupt a weight sync in transit,
see :class:`postrl.testing.faults.CorruptSync`).

Installs a :class:`~postrl.testing.faults.KillAt` hook for ``POINT`` in this process, then runs
the ``postrl`` command line that follows exactly as the ``postrl`` console script would (e.g.
``train examples/grpo_addition.yaml trainer.run_dir=/tmp/r``). The process dies by SIGKILL
(exit status -9 to a parent) when the trainer reaches the point. If the command finishes without
ever reaching it — a misspelt point, or a run too short — this exits with status 3 and says which
points were reached, so a crash test can never pass by not crashing.

Test-only: the library never reads a kill point; this entry point is how a test puts one into a
training subprocess (``tests/trainer/test_resume.py``).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["NOT_REACHED", "main"]

NOT_REACHED = 3
"""Exit status when the command finished without reaching the kill point."""


def main(argv: list[str] | None = None) -> int:
    """Run ``postrl <command...>`` with a SIGKILL hook at ``--kill-at``; see the module
    docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m postrl.testing.faults_run",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    ap.add_argument(
        "--kill-at",
        metavar="POINT",
        help="fault point to SIGKILL at, e.g. step3:after_gen (see postrl.trainer.hooks)",
    )
    ap.add_argument(
        "--corrupt-sync",
        type=int,
        metavar="STEP",
        help="corrupt one tensor of the weight sync after step STEP, once (the run recovers)",
    )
    ap.add_argument(
        "--corrupt-sync-always",
        type=int,
        metavar="STEP",
        help="corrupt it on every try from step STEP on (the run stops naming the tensor)",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the postrl command line to run")
    args = ap.parse_args(argv)
    faults = [args.kill_at, args.corrupt_sync, args.corrupt_sync_always]
    if sum(f is not None for f in faults) != 1:
        ap.error("give exactly one of --kill-at POINT, --corrupt-sync STEP, --corrupt-sync-always")
    if not args.command:
        ap.error("give the postrl command to run after the fault, e.g. `train CONFIG`")

    from postrl.cli import main as postrl_main
    from postrl.testing.faults import install_corrupt_sync, install_kill_at

    if args.kill_at is None:
        always = args.corrupt_sync is None
        fault = install_corrupt_sync(
            args.corrupt_sync_always if always else args.corrupt_sync, always
        )
        rc = postrl_main(args.command)
        if fault.corrupted == 0:
            sys.stderr.write("faults_run: no weight sync was corrupted (run too short?)\n")
            return NOT_REACHED
        return rc
    hook = install_kill_at(args.kill_at)
    rc = postrl_main(args.command)
    if rc == 0:
        sys.stderr.write(
            f"faults_run: the command finished without reaching kill point {args.kill_at!r}; "
            f"points reached: {sorted(set(hook.seen)) or 'none'}\n"
        )
        return NOT_REACHED
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
