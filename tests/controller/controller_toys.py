"""Toy workers shared by the controller tests (importable by Ray actors: a real module)."""

from __future__ import annotations

import os
import time

import torch

from postrl.controller import Dispatch, Execute, Worker, make_nd_compute_dispatch, register
from postrl.protocol import DataProto


class ToyWorker(Worker):
    """Adds ``offset`` to data; records what it saw so tests can check dispatch."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.seen: list[int] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str = "") -> tuple[int, int, str]:
        return (self.rank, self.world_size, tag)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def times_rank(self, x: int, *, y: int = 1) -> int:
        return x * y * (self.rank + 1)

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def only_zero(self, x: int) -> tuple[int, int]:
        return (self.rank, x + 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def shard_sum(self, xs: list[int]) -> int:
        return sum(xs)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_offset(self, data: DataProto, scale: float = 1.0) -> DataProto:
        self.seen.append(len(data))
        x = data.batch["x"]
        out = DataProto.from_dict(
            {
                "y": x * scale + self.offset + 0 * self.rank,
                "rank": torch.full((len(data),), self.rank),
            }
        )
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_offset_async(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] + self.offset})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen_sizes(self) -> list[int]:
        return list(self.seen)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def boom(self, on_rank: int = 1) -> int:
        if self.rank == on_rank:
            raise ValueError(f"boom on rank {self.rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, timeout_s=60.0)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())


class MeshWorker(Worker):
    """Fake 2 x 2 (dp x tp) layout: rank r -> dp_rank r // 2, tp_rank r % 2; tp 0 collects."""

    def __init__(self, tp: int = 2) -> None:
        self.tp_rank = self.rank % tp
        self.register_dp_info(
            "actor",
            dp_rank=self.rank // tp,
            dp_size=self.world_size // tp,
            is_collect=self.tp_rank == 0,
        )

    @register(dispatch_mode=make_nd_compute_dispatch("actor"))
    def forward(self, data: DataProto) -> DataProto:
        # every tp replica returns its own tp_rank: the driver must only see tp_rank 0
        n = len(data)
        return DataProto.from_dict(
            {
                "x": data.batch["x"],
                "tp": torch.full((n,), self.tp_rank),
                "rank": torch.full((n,), self.rank),
            }
        )


class RefToy(Worker):
    """Second role for colocation tests."""

    def __init__(self, bias: float = 0.0) -> None:
        self.bias = bias
        self.register_dp_info("ref", dp_rank=self.rank, dp_size=self.world_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_offset(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] + self.bias})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def peer_offset(self) -> float:
        return self.colocated["actor"].offset  # same-process access to the other role
