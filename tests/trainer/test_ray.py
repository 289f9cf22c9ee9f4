"""The same GRPO driver on the Ray backend (2 CPU workers, dp=2) and on the local backend.

One Ray cluster per module (``num_cpus=2``); every worker process and the cluster itself must be
gone at the end.

Why "same" is checked with a tolerance and one mini-batch per step:

* dp=2 sums two half-batch gradients (and all-reduces the loss denominators) where dp=1 sums
  one, so the results agree up to float reduction order (~1e-7 relative), not bit for bit.
* With several mini-batches per step, which rows share an optimizer step depends on the dp size
  (each rank splits its own shard, as in verl) — a different but equally valid schedule. With
  one mini-batch per step (``ppo_mini_batch_size = train_batch_size``) both backends take exactly
  the same optimizer steps.
* Adam's first steps are ≈ lr·sign(g), which turns float noise on a ~0 gradient into a ±lr
  weight change that then moves step-2 metrics far above 1e-7. ``optim.eps`` ≫ |g| makes AdamW
  an SGD (update ≈ lr·g/eps), so differences stay at float-noise level.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray")

from test_e2e import EXPECTED_KEYS  # noqa: E402

from postrl.config import load_config  # noqa: E402
from postrl.trainer.trainer import RLTrainer  # noqa: E402

pytestmark = pytest.mark.ray

SAME_UPDATES = [
    "actor.ppo_mini_batch_size=4",  # = data.train_batch_size: one optimizer step per RL step
    "actor.optim.lr=10.0",
    "actor.optim.eps=1000.0",  # AdamW ≈ SGD with lr 1e-2 (see module docstring)
    # time: validation still runs (and is compared) at the last step
    "trainer.val_before_train=false",
]
# wall-clock, the dp>1-only balancing stage, and the weight transport (frames vs in-process tensors)
NOT_COMPARED = ("timing_s/", "perf/", "balance/", "weights/", "driver/")
"""(``driver/*``: the bytes of remote calls through the driver, which only Ray has.)"""


def _ray_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(p.cmdline()).lower():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    deadline = time.monotonic() + 20.0
    while _ray_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _ray_children()
    assert not left, f"Ray processes left behind: {[(p.pid, p.name()) for p in left]}"


def _rows(cfg) -> list[dict]:
    return [
        json.loads(ln)
        for ln in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def _run(overrides: list[str]) -> tuple[dict, list[dict], list[int]]:
    """Fit, close; returns (last metrics, metrics.jsonl rows, worker pids)."""
    cfg = load_config(None, overrides)
    trainer = RLTrainer(cfg)
    try:
        pids = list(getattr(trainer.roles.actor, "pids", []))
        last = trainer.fit()
    finally:
        trainer.close()
    return last, _rows(cfg), pids


def _wait_dead(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}


def test_grpo_ray_dp2_matches_local(ray_cluster, small_overrides, digits_reward, tmp_path):
    base = [*small_overrides, f"reward.custom_function.path={digits_reward}", *SAME_UPDATES]

    last, ray_rows, pids = _run(
        [
            *base,
            "trainer.backend=ray",
            "trainer.num_workers=2",
            # rollout.weight_sync is honoured on Ray: the actor's frames are 48 KiB buckets,
            # pulled one at a time and forwarded to the replica as they are
            "rollout.weight_sync=bucketed",
            "rollout.weight_bucket_mb=0.046875",
            f"trainer.run_dir={tmp_path / 'ray'}",
        ]
    )
    assert len(pids) == 2, "the ray run should have started 2 actor workers"
    from safetensors.torch import load_file

    model_dir = next(o.split("=", 1)[1] for o in small_overrides if o.startswith("model.path="))
    tensors = load_file(str(Path(model_dir) / "model.safetensors")).values()
    largest = max(t.numel() * t.element_size() for t in tensors)  # an oversized one goes alone
    assert last["weights/buckets"] > 5
    assert last["weights/max_bucket_bytes"] <= max(48 << 10, largest)
    assert last["weights/tensors"] > 0 and last["weights/version"] == 3
    assert not _wait_dead(pids), "actor workers still alive after trainer.close()"
    assert EXPECTED_KEYS <= set(last), sorted(EXPECTED_KEYS - set(last))
    assert all(math.isfinite(v) for v in last.values()), {
        k: v for k, v in last.items() if not math.isfinite(v)
    }
    assert last["reward/generated"] == 16 == last["reward/scored"] + last["reward/failed/total"]
    assert last["actor/grad_norm"] > 0
    assert last["driver/out_tensor_bytes"] > 0  # the driver data plane ships the batch

    _, local_rows, _ = _run([*base, f"trainer.run_dir={tmp_path / 'local'}"])
    assert [r["step"] for r in ray_rows] == [r["step"] for r in local_rows] == [1, 2]
    for r_ray, r_loc in zip(ray_rows, local_rows, strict=True):
        a, b = _comparable(r_ray), _comparable(r_loc)
        assert set(a) == set(b), (r_ray["step"], sorted(set(a) ^ set(b)))
        bad = {k: (a[k], b[k]) for k in a if a[k] != pytest.approx(b[k], rel=1e-4, abs=1e-5)}
        assert not bad, f"step {r_ray['step']}: ray vs local differ: {bad}"
