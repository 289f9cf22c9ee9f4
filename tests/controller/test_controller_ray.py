"""Ray backend on CPU: one local Ray cluster per module (num_cpus=2), fractional-CPU actors."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

import controller_toys  # noqa: E402
from controller_toys import MeshWorker, RefToy, ToyWorker  # noqa: E402

from postrl.controller import (  # noqa: E402
    ControllerError,
    ResourcePool,
    Timeouts,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    create_colocated_worker_cls,
    create_worker_group,
)
from postrl.protocol import DataProto  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # the toy module lives in tests/ (not importable in workers): ship it by value
    ray.cloudpickle.register_pickle_by_value(controller_toys)
    yield
    ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_dead(pids: list[int], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]}
    )


def driver_script(wg) -> dict:
    """The same driver code for every backend."""
    out = wg.add_offset(rows(10), scale=2.0)
    chained = wg.add_offset(wg.add_offset_async(wg.add_offset_async(rows(7))))  # padded
    passthrough = wg.add_offset(wg.add_offset_async(rows(8)))  # a future into the next call
    return {
        "whoami": wg.whoami("x"),
        "all_to_all": wg.times_rank([1, 2], y=[3, 4]),
        "rank_zero": wg.only_zero(1),
        "dp_compute": wg.shard_sum([[1, 2], [3]]),
        "y": out.batch["y"].tolist(),
        "rank": out.batch["rank"].tolist(),
        "uid": out.non_tensor_batch.get("uid"),
        "chained": chained.batch["y"].tolist(),
        "passthrough": passthrough.batch["y"].tolist(),
    }


def test_group_gloo_allreduce_dp_proto_and_local_equivalence(ray_cluster):
    wg = create_worker_group("ray", ToyWorker, kwargs={"offset": 100.0}, world_size=2, name="toy")
    try:
        assert wg.all_reduce(1.0) == [3.0, 3.0]  # 1*1 + 1*2 over a gloo group
        res_ray = driver_script(wg)
        assert res_ray["y"] == [2.0 * i + 100 for i in range(10)]  # 10 rows over 2 ranks, in order
        assert res_ray["rank"] == [0] * 5 + [1] * 5
        assert res_ray["chained"] == [i + 300.0 for i in range(7)]
        assert res_ray["passthrough"] == [i + 200.0 for i in range(8)]
        pids = wg.pid()
        assert len(set(pids)) == 2 and os.getpid() not in pids
    finally:
        wg.shutdown()
    assert _wait_dead(pids), "worker processes outlived shutdown()"
    local = create_worker_group(
        "local", ToyWorker, kwargs={"offset": 100.0}, world_size=2, name="toy"
    )
    assert driver_script(local) == res_ray


def test_nd_dispatch_2x2_in_colocated_group(ray_cluster):
    """Fake dp=2 x tp=2 layout (rank r: dp r//2, tp r%2) hosted next to a second role."""
    fused = create_colocated_worker_cls({"mesh": MeshWorker, "ref": RefToy})
    wg = create_worker_group(
        "ray", fused, kwargs={"ref": {"bias": 0.5}}, world_size=4, name="fused", init_dist=False
    )
    try:
        out = wg.mesh.forward(rows(6))  # same shard to both tp ranks, collected once per dp rank
        assert out.batch["x"].tolist() == list(range(6))
        assert out.batch["tp"].tolist() == [0] * 6
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]
        assert wg.ref_add_offset(rows(3)).batch["y"].tolist() == [0.5, 1.5, 2.5]
    finally:
        wg.shutdown()


def test_raising_then_killed_worker(ray_cluster):
    """A raise names rank+method (group kept: shutdown_on_error=False); a kill errors fast."""
    wg = create_worker_group(
        "ray",
        ToyWorker,
        world_size=2,
        name="actor",
        init_dist=False,
        shutdown_on_error=False,
        timeouts=Timeouts(per_method={"sleep": 10.0}),
        resource_pool=ResourcePool(process_on_nodes=(2,), name="kill_pool"),
    )
    pids = wg.pid()
    with pytest.raises(WorkerError) as ei:
        wg.boom(on_rank=1)
    e = ei.value
    assert (e.role, e.rank, e.method, e.exc_type) == ("actor", 1, "boom", "ValueError")
    assert "boom on rank 1" in e.remote_traceback and not wg.closed
    fut = wg.submit("sleep", 30.0)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as ei:
        fut.result()  # the configured 10 s deadline bounds the wait
    assert time.monotonic() - t0 < 10.0 and ei.value.rank == 1 and ei.value.method == "sleep"
    assert wg.closed and _wait_dead(pids), "siblings must be shut down after a dead worker"


def test_stuck_worker_times_out(ray_cluster):
    wg = create_worker_group(
        "ray",
        ToyWorker,
        world_size=1,
        name="slow",
        init_dist=False,
        timeouts=Timeouts(per_method={"sleep": 1.5}),
    )
    pids = wg.pid()
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match="rank"):
        wg.sleep(30.0)
    assert time.monotonic() - t0 < 5.0
    assert _wait_dead(pids)


def test_unplaceable_pool_fails_fast_with_resources(ray_cluster):
    pool = ResourcePool(process_on_nodes=(2,), num_cpus_per_process=8.0, name="too_big")
    t0 = time.monotonic()
    with pytest.raises(ControllerError, match="could not be placed"):
        create_worker_group(
            "ray", ToyWorker, resource_pool=pool, timeouts=Timeouts(init_s=2.0), name="big"
        )
    assert time.monotonic() - t0 < 10.0
