"""``ResourcePool``: where a worker group's processes go (backend-neutral description).

A pool lists processes per node and what each process reserves. The Ray backend turns it into
one placement group per node (bundles of ``{"CPU": c, "GPU": g}``); several worker groups that
receive the *same* pool object share those bundles (colocated groups, at most
``max_colocate_count`` per bundle, each taking its share of the bundle's resources). The local
backend ignores pools.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

__all__ = ["ResourcePool", "free_port"]


@dataclass(frozen=True)
class ResourcePool:
    """Processes per node and per-process resources.

    Attributes:
        process_on_nodes: number of worker processes on each node, e.g. ``(8, 8)``.
        use_gpu: reserve ``num_gpus_per_process`` GPUs per process (and use nccl).
        num_cpus_per_process: CPUs per process; fractional values let small machines host
            several workers (tests use 0.1).
        num_gpus_per_process: GPUs per process when ``use_gpu``.
        max_colocate_count: how many worker groups may share one bundle.
        name: pool name (placement-group names derive from it).
        strategy: Ray placement strategy per node ("STRICT_PACK" keeps a node's bundles together).
    """

    process_on_nodes: tuple[int, ...] = (1,)
    use_gpu: bool = False
    num_cpus_per_process: float = 0.1
    num_gpus_per_process: float = 1.0
    max_colocate_count: int = 1
    name: str = "pool"
    strategy: str = "STRICT_PACK"

    def __post_init__(self) -> None:
        if not self.process_on_nodes or any(n < 1 for n in self.process_on_nodes):
            raise ValueError(
                f"ResourcePool.process_on_nodes={self.process_on_nodes}: "
                "every node needs >= 1 process"
            )
        if self.num_cpus_per_process <= 0:
            raise ValueError(
                f"ResourcePool.num_cpus_per_process={self.num_cpus_per_process} must be > 0 "
                "(bundles cannot be empty)"
            )
        if self.max_colocate_count < 1:
            raise ValueError(
                f"ResourcePool.max_colocate_count={self.max_colocate_count} must be >= 1"
            )

    @property
    def world_size(self) -> int:
        """Total number of processes."""
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        """Resources of one process's bundle."""
        b = {"CPU": float(self.num_cpus_per_process)}
        if self.use_gpu:
            b["GPU"] = float(self.num_gpus_per_process)
        return b


def free_port() -> int:
    """A TCP port that is free right now on this host (for torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
