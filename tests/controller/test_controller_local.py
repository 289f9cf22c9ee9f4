"""Local backend: every dispatch mode, futures, colocation, errors (no Ray)."""

from __future__ import annotations

import sys

import pytest
import torch
from controller_toys import MeshWorker, RefToy, ToyWorker

from postrl.controller import (
    ControllerError,
    Dispatch,
    Worker,
    WorkerError,
    create_colocated_worker_cls,
    create_worker_group,
    get_dispatch_spec,
    register,
    register_dispatch_mode,
)
from postrl.protocol import DataProto


def rows(n: int) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]}
    )


@pytest.fixture
def wg():
    g = create_worker_group("local", ToyWorker, kwargs={"offset": 100.0}, world_size=3, name="toy")
    yield g
    g.shutdown()


def test_import_does_not_load_ray():
    import subprocess

    code = "import sys, postrl.controller; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spec_is_frozen_dataclass():
    spec = get_dispatch_spec(ToyWorker.add_offset)
    assert spec.dispatch_mode == Dispatch.DP_COMPUTE_PROTO and spec.blocking
    with pytest.raises(AttributeError):
        spec.blocking = False  # type: ignore[misc]


def test_one_to_all_all_to_all_rank_zero_dp_compute(wg):
    assert wg.whoami("t") == [(0, 3, "t"), (1, 3, "t"), (2, 3, "t")]
    assert wg.times_rank([1, 2, 3], y=[10, 10, 10]) == [10, 40, 90]
    assert wg.only_zero(41) == (0, 42)
    assert wg.shard_sum([[1, 2], [3], []]) == [3, 3, 0]
    with pytest.raises(ControllerError, match="one entry per rank"):
        wg.shard_sum([[1], [2]])


def test_dp_compute_proto_pads_and_unpads(wg):
    out = wg.add_offset(rows(10), scale=2.0)  # 10 rows over 3 ranks -> pad 2, 4 rows each
    assert len(out) == 10
    assert torch.equal(out.batch["y"], torch.arange(10, dtype=torch.float32) * 2 + 100)
    assert out.batch["rank"].tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert wg.seen_sizes() == [[4], [4], [4]]


def test_future_passes_into_next_call(wg):
    fut = wg.add_offset_async(rows(6))
    assert not isinstance(fut, DataProto)
    fut2 = wg.add_offset_async(fut)  # resolved, then split again
    out = wg.add_offset(fut2)
    assert torch.equal(out.batch["y"], torch.arange(6, dtype=torch.float32) + 300)


def test_nd_dispatch_fake_2x2_layout():
    g = create_worker_group("local", MeshWorker, world_size=4, name="mesh")
    assert [(i.dp_rank, i.dp_size, i.is_collect) for i in g.dp_info("actor")] == [
        (0, 2, True),
        (0, 2, False),
        (1, 2, True),
        (1, 2, False),
    ]
    out = g.forward(rows(5))  # pad to 6, 3 rows per dp rank
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]
    assert out.batch["tp"].tolist() == [0] * 5  # collected from tp rank 0 only
    assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2]


def test_custom_mode_registered_from_outside():
    def dispatch(ctx, args, kwargs):  # reversed ranks receive a list's items
        (items,) = args
        return [((items[ctx.world_size - 1 - r],), {}) for r in range(ctx.world_size)]

    def collect(ctx, outputs):
        return sum(outputs)

    register_dispatch_mode("reverse_sum_test", dispatch, collect)

    class W(Worker):
        @register(dispatch_mode="reverse_sum_test")
        def f(self, x: int) -> int:
            return x * 10**self.rank

    g = create_worker_group("local", W, world_size=2)
    assert g.f([1, 2]) == 2 + 10
    with pytest.raises(KeyError, match="did you mean"):
        register(dispatch_mode="reverse_sum_tset")


def test_raising_worker_names_rank_and_method(wg):
    with pytest.raises(WorkerError) as ei:
        wg.boom(on_rank=1)
    e = ei.value
    assert (e.role, e.rank, e.method, e.exc_type) == ("toy", 1, "boom", "ValueError")
    assert "boom on rank 1" in str(e) and "Traceback" in e.remote_traceback
    assert isinstance(e.__cause__, ValueError)
    assert wg.closed
    with pytest.raises(ControllerError, match="shut down"):
        wg.whoami()


def test_constructor_error_is_worker_error():
    with pytest.raises(WorkerError, match="__init__"):
        create_worker_group("local", ToyWorker, kwargs={"nope": 1})


def test_colocated_roles_namespaced():
    Fused = create_colocated_worker_cls({"actor": ToyWorker, "ref": RefToy})
    g = create_worker_group(
        "local", Fused, kwargs={"actor": {"offset": 1.0}, "ref": {"bias": -1.0}}, world_size=2
    )
    out_a = g.actor.add_offset(rows(4))
    out_b = g.actor_add_offset(rows(4))
    assert torch.equal(out_a.batch["y"], out_b.batch["y"])
    assert g.ref.add_offset(rows(4)).batch["y"].tolist() == [-1.0, 0.0, 1.0, 2.0]
    assert g.ref.peer_offset() == [1.0, 1.0]
    assert g.dp_info("ref")[1].dp_rank == 1


def test_unknown_backend_lists_choices():
    with pytest.raises(KeyError, match="local"):
        create_worker_group("rya", ToyWorker)


def test_local_init_dist_world_one():
    g = create_worker_group("local", ToyWorker, init_dist=True)
    try:
        assert g.all_reduce(2.0) == [2.0]
    finally:
        g.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_docs_example_mode_runs():
    """The 'adding a mode' example in docs/controller.md works as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "controller.md").read_text()
    block = re.search(r"### Adding a mode.*?```python\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(block, "docs/controller.md", "exec"), ns)  # registers "by_group"

    class Scorer(Worker):
        @register(dispatch_mode="by_group")
        def score(self, data: DataProto) -> DataProto:
            return DataProto.from_dict(
                {"x": data.batch["x"], "rank": torch.full((len(data),), self.rank)},
                {"uid": data.non_tensor_batch["uid"]},
            )

    g = create_worker_group("local", Scorer, world_size=3)
    data = DataProto.from_dict(
        {"x": torch.arange(12.0)}, {"uid": [f"g{i // 4}" for i in range(12)]}
    )
    out = g.score(data)
    assert out.batch["x"].tolist() == list(range(12))  # original order restored
    for grp in range(3):  # a group's rows were scored on one rank
        assert len(set(out.batch["rank"][grp * 4 : grp * 4 + 4].tolist())) == 1
