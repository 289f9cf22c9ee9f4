"""What crosses the driver: bytes sent to and received from remote actors, by channel.

The single controller should move control, not data. Every remote call of the ``ray`` backend
(worker-group methods, rollout replicas, rollout-side trajectories) counts what the driver
sends and what it gets back in :data:`DRIVER_TRAFFIC`, per channel (e.g.
``"actor.update_actor"``, ``"rollout.trajectory"``, ``"weights"``); the trainer reports each
step's totals as ``driver/*`` metrics, and the tests of the object-store data plane read the
channels to check that no trajectory tensor passes through the driver.

Sizes are measured by walking the value (tensors and arrays by ``nbytes``, strings and bytes by
length, scalars as 8 bytes, an ``ObjectRef`` by its id), not by serialising it a second time:
close to what Ray ships, and exact about what matters here — the tensor bytes.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import defaultdict
from typing import Any

__all__ = ["DRIVER_TRAFFIC", "DriverTraffic", "measure"]

_REF_BYTES = 28  # an ObjectRef travels as its id


def measure(value: Any) -> tuple[int, int]:
    """``(bytes, tensor_bytes)`` of ``value``: its approximate serialised size, and the part
    made of tensors / numeric arrays (a batch's payload)."""
    total, tensors = 0, 0
    stack = [value]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v is None or isinstance(v, (bool, int, float)):
            total += 8
            continue
        if isinstance(v, (str, bytes, bytearray, memoryview)):
            total += len(v.encode()) if isinstance(v, str) else len(v)
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        kind = type(v).__module__.split(".")[0]
        if kind == "torch" and hasattr(v, "element_size"):
            n = v.numel() * v.element_size()
            total, tensors = total + n, tensors + n
        elif kind == "numpy" and hasattr(v, "dtype"):
            if v.dtype == object:
                stack.extend(v.ravel().tolist())
            else:
                total, tensors = total + v.nbytes, tensors + v.nbytes
        elif type(v).__name__ == "ObjectRef":
            total += _REF_BYTES
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        elif hasattr(v, "batch") and hasattr(v, "non_tensor_batch"):  # DataProto
            stack.extend([dict(v.batch), v.non_tensor_batch, v.meta_info])
        elif hasattr(v, "__dict__"):
            stack.append(vars(v))
        else:
            total += sys.getsizeof(v)
    return total, tensors


class DriverTraffic:
    """Thread-safe byte counters per ``(direction, channel)``; :meth:`take` reads and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def count(self, direction: str, channel: str, value: Any) -> None:
        """Count ``value`` sent (``direction="out"``) or received (``"in"``) on ``channel``."""
        n, t = measure(value)
        with self._lock:
            c = self._bytes[(direction, channel)]
            c[0] += n
            c[1] += t
            c[2] += 1

    def take(self) -> dict[tuple[str, str], tuple[int, int, int]]:
        """``{(direction, channel): (bytes, tensor_bytes, messages)}`` since the last take."""
        with self._lock:
            out = {k: (v[0], v[1], v[2]) for k, v in self._bytes.items()}
            self._bytes.clear()
        return out

    @staticmethod
    def metrics(counts: dict[tuple[str, str], tuple[int, int, int]]) -> dict[str, float]:
        """``driver/{in,out}_bytes``, ``driver/{in,out}_tensor_bytes`` from :meth:`take`'s
        counts, with two channels apart: weight frames (``driver/weight_bytes``) and the
        prompts sent to the rollout (``driver/prompt_bytes``)."""
        m: dict[str, float] = {}
        for (direction, channel), (n, t, _) in counts.items():
            apart = (
                "weight"
                if channel == "weights" or channel.endswith("weight_frame")
                else "prompt"
                if channel == "prompts"
                else None
            )
            if apart is not None:
                m[f"driver/{apart}_bytes"] = m.get(f"driver/{apart}_bytes", 0.0) + n
                continue
            for key, v in (
                (f"driver/{direction}_bytes", n),
                (f"driver/{direction}_tensor_bytes", t),
            ):
                m[key] = m.get(key, 0.0) + v
        return m


DRIVER_TRAFFIC = DriverTraffic()
"""The process's counters (the driver's: remote calls count here)."""
