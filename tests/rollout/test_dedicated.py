"""``postrl.rollout.dedicated``: the dedicated replicas of a run, started all or none.

The runs that start them for real (processes and Ray actors, restarts included) are
``tests/trainer/test_fully_async.py``, ``test_fully_async_ray.py`` and ``test_object_store.py``;
here, what those do not reach: the spec's deadlines, a placement too small for the replicas, and
a failed start that leaves nothing behind.
"""

from __future__ import annotations

import os

import pytest

from postrl.rollout.dedicated import (
    DedicatedReplicas,
    DedicatedSpec,
    ReplicaPlacement,
    replica_deadlines,
)
from postrl.rollout.types import RolloutError


def test_an_own_process_backend_gets_the_long_deadlines():
    # control: max(given, 300) for vllm (its engine reloads slowly), as given for native;
    # start-up: max(request deadline, 900) for vllm, max(request deadline, 120) for native
    native = DedicatedSpec("native", "m", 1, control_timeout_s=30.0, request_timeout_s=60.0)
    vllm = DedicatedSpec("vllm", "m", 1, control_timeout_s=30.0, request_timeout_s=60.0)
    assert replica_deadlines(native) == (30.0, 120.0)
    assert replica_deadlines(vllm) == (300.0, 900.0)


def test_a_placement_needs_a_bundle_per_replica():
    released = []
    with pytest.raises(ValueError, match="placement has 1 bundles for 2 replicas"):
        DedicatedReplicas(
            DedicatedSpec("native", "m", 2),
            placement=ReplicaPlacement(["s0"], lambda: released.append(1)),
        )


def test_a_failed_start_closes_everything_and_names_the_log(tmp_path):
    """A replica process that cannot load its model: ``RolloutError`` naming its log, and
    ``on_close`` ran (the caller's actors and placement are given back)."""
    closed = []
    spec = DedicatedSpec(
        "native", str(tmp_path / "no-such-model"), 1, run_dir=str(tmp_path / "run"), nice=5
    )
    pool = DedicatedReplicas(spec, on_close=(lambda: closed.append("owner"),))
    with pytest.raises(RolloutError, match="rollout_replica_0.log"):
        pool.start()
    assert closed == ["owner"]
    assert (tmp_path / "run" / "rollout_replica_0.log").exists()
    pool.close()  # idempotent
    assert closed == ["owner"]


def test_a_killed_runs_shared_directory_is_swept_and_a_live_ones_kept(tmp_path):
    """A SIGKILLed trainer never closes its replicas' shared directory (weight buffers hold
    tmpfs memory): the next run removes those of dead processes, never a live one's."""
    import subprocess
    import sys

    from postrl.rollout.dedicated import sweep_shared_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"postrl-shared-{dead.pid}-abc"
    live = tmp_path / f"postrl-shared-{os.getpid()}-def"
    other = tmp_path / "postrl-shared-notapid"
    for d in (gone, live, other):
        d.mkdir()
        (d / "weights-0.buf").write_bytes(b"x")
    assert sweep_shared_dirs(str(tmp_path)) == 1
    assert not gone.exists() and live.exists() and other.exists()
    assert sweep_shared_dirs(str(tmp_path / "missing")) == 0
