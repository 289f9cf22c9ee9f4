"""The data plane of the replay buffer: trajectory payloads by key.

The control plane (:mod:`postrl.trainer.asynchronous.replay.tags`, the buffer, samplers)
decides from tags alone; payloads — the data plane's handle of a trajectory
(:mod:`postrl.trainer.runner`) — are written when a trajectory is generated (replaced once when its
group is scored) and read for training once, when a batch is assembled from the sampled keys.
:class:`LocalTrajectoryStore` keeps the handles in this process: on the ``driver`` plane a handle
holds the trajectory itself, on the ``object_store`` plane it is a tag with a Ray object reference
(the payload stays in Ray's object store, freed when the last reference goes). Another store fits
the same :class:`TrajectoryStore` protocol.

A store never inspects a payload: it keeps the reference as given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from postrl.trainer.asynchronous.replay.tags import TrajectoryKey

__all__ = ["TrajectoryStore", "LocalTrajectoryStore", "MissingTrajectoryError"]


class MissingTrajectoryError(KeyError):
    """A payload was asked for that the store does not hold; the message names the key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrajectoryStore(Protocol):
    """Payloads by ``(group uid, sample index)``."""

    def put(self, key: TrajectoryKey, payload: Any) -> None:
        """Store ``payload`` under ``key`` (replacing nothing: a key is written once)."""
        ...

    def get(self, key: TrajectoryKey) -> Any:
        """The payload of ``key`` (raises :class:`MissingTrajectoryError`)."""
        ...

    def pop(self, key: TrajectoryKey) -> Any:
        """Remove and return the payload of ``key`` (raises :class:`MissingTrajectoryError`)."""
        ...

    def discard(self, key: TrajectoryKey) -> bool:
        """Remove ``key`` without reading its payload; whether it was there."""
        ...

    def keys(self) -> Iterator[TrajectoryKey]:
        """The stored keys (payloads not touched)."""
        ...


class LocalTrajectoryStore:
    """In-process store: a dict of key → payload reference (the ``local`` backend)."""

    def __init__(self) -> None:
        self._data: dict[TrajectoryKey, Any] = {}

    def put(self, key: TrajectoryKey, payload: Any) -> None:
        """Store ``payload`` under ``key``; writing a key twice is a bug and raises."""
        if key in self._data:
            raise ValueError(
                f"trajectory {key!r} is already stored; a trajectory finishes once (a resumed "
                f"request must not report finish twice)"
            )
        self._data[key] = payload

    def get(self, key: TrajectoryKey) -> Any:
        """The payload of ``key``."""
        try:
            return self._data[key]
        except KeyError:
            raise MissingTrajectoryError(f"no stored trajectory {key!r}") from None

    def pop(self, key: TrajectoryKey) -> Any:
        """Remove and return the payload of ``key``."""
        try:
            return self._data.pop(key)
        except KeyError:
            raise MissingTrajectoryError(f"no stored trajectory {key!r}") from None

    def discard(self, key: TrajectoryKey) -> bool:
        """Remove ``key`` if present, without reading the payload."""
        return self._data.pop(key, _ABSENT) is not _ABSENT

    def keys(self) -> Iterator[TrajectoryKey]:
        """The stored keys."""
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data


_ABSENT = object()
