"""Helpers shared by the trainer tests.

Imported by module name: pytest puts this folder on sys.path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

WALL_CLOCK = ("timing_s/", "perf/")
"""Metric prefixes that differ between two runs with the same seed (wall-clock)."""


def train_subprocess(
    args: list[str], threads: int, kill_at: str | None = None, timeout: float = 600
) -> int:
    """``postrl train ARGS`` in a subprocess at ``threads`` threads; with ``kill_at`` the
    test-side hook (``postrl.testing.faults_run``) SIGKILLs it at that fault point. Returns the
    exit code (-9 when killed); prints the tail of stderr on any other failure."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("POSTRL_KILL_AT", None)
    launcher = ["postrl.testing.faults_run", "--kill-at", kill_at] if kill_at else ["postrl.cli"]
    cmd = [sys.executable, "-m", *launcher, "train", *args, f"trainer.num_threads={threads}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, -9):
        print(proc.stderr[-4000:])
    return proc.returncode


def metric_rows(run: Path) -> list[dict]:
    """``run/metrics.jsonl`` rows without the wall-clock keys."""
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def checkpoint_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Every actor tensor of checkpoint ``step`` of ``run``, keyed ``file:name``."""
    out = {}
    for f in sorted((run / "checkpoints" / f"step_{step:06d}" / "actor").rglob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    assert out, "no actor tensors in the checkpoint"
    return out


def assert_same_run(a: Path, b: Path, steps: int) -> None:
    """Runs ``a`` and ``b`` logged the same metric rows (wall clock aside) for steps ``1 ..
    steps`` and saved bit-identical actor weights at checkpoint ``steps``."""
    ra, rb = metric_rows(a), metric_rows(b)
    assert len(ra) == steps and [r["step"] for r in ra] == list(range(1, steps + 1))
    for x, y in zip(ra, rb, strict=True):
        assert x == y, f"step {x['step']}: {[k for k in x if x[k] != y.get(k)]}"
    wa, wb = checkpoint_weights(a, steps), checkpoint_weights(b, steps)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def actor_params(trainer: Any) -> dict[str, torch.Tensor]:
    """A detached copy of the actor's weights (HF names)."""
    return {k: v.detach().clone() for k, v in trainer.roles.actor.get_per_tensor_param()}


def fit_with_snapshots(
    trainer: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]:
    """``(actor weights before, last step's metrics, actor weights after)`` of ``trainer.fit()``."""
    before = actor_params(trainer)
    last = trainer.fit()
    return before, last, actor_params(trainer)


def each_prompt_once_per_epoch(run: Path, epochs: int, size: int, steps_per_epoch: int) -> None:
    """``run``'s ``trained_prompts.jsonl`` has every step once, no group uid twice, and every
    one of the ``size`` dataset rows exactly once per epoch (async modes: nothing lost or
    duplicated, across kills and resumes)."""
    from collections import Counter

    from postrl.trainer.ledger import read_ledger

    rows = read_ledger(run)
    assert [r["step"] for r in rows] == list(range(1, steps_per_epoch * epochs + 1))
    uids = Counter(u for r in rows for u in r["uid"])
    assert max(uids.values()) == 1, "a group was trained twice"

    def drawn_in(r: dict) -> list[int]:  # each group's own epoch where the ledger has it
        return r.get("epochs") or [r["epoch"]] * len(r["index"])

    for e in range(epochs):
        idx = Counter(i for r in rows for i, ge in zip(r["index"], drawn_in(r)) if ge == e)
        assert sorted(idx) == list(range(size)), f"epoch {e}: prompts lost {idx}"
        assert set(idx.values()) == {1}, f"epoch {e}: prompts duplicated {idx}"


def fully_async_overrides(model_dir, train, test, reward, run, steps: int = 16) -> list[str]:
    """A small ``trainer.mode=fully_async`` run: 4 prompts × 4 samples per version, mini-batches
    of 2 groups (8 steps per epoch of 16 prompts), decoupled PPO, a push every 2 steps."""
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "actor.policy_loss=decoupled",
        "rollout.n=4",
        "rollout.response_length=8",
        "trainer.mode=fully_async",
        "trainer.async.parameter_sync_step=2",
        "trainer.async.max_staleness=1",
        f"trainer.total_steps={steps}",
        "trainer.test_freq=8",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.num_threads=1",
        f"reward.custom_function.path={reward}",
        f"trainer.run_dir={run}",
    ]


def await_replacement(trainer: Any, dead: Any, timeout_s: float = 300.0) -> None:
    """From a fault hook: wait (on events; ``timeout_s`` is a generous multiple of a restart,
    which takes seconds) until ``dead`` (a replica handle) is declared dead and its replacement
    has finished starting; it joins at the next weight push."""
    assert dead.wait_dead(timeout_s), f"the killed replica was not declared dead in {timeout_s}s"
    restarter = trainer.mode.restarter
    restarter.begin()  # (a no-op when a step already began the restart)
    if not any(r is dead for r in restarter.fleet.replicas):
        return  # a step began the restart and a push already installed the replacement
    assert restarter.pending, "no restart was begun for the dead replica"
    restarter.wait_started(timeout_s)
