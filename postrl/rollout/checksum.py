"""Per-tensor checksums of weight updates: the receiving half of the weight-sync contract.

A replica records the CRC-32 of every tensor's raw bytes as it loads them
(:class:`ReceivedWeights`); the sender (``postrl.weights.verify``) computes the same over what
it sent, and the two manifests are compared after every sync. A byte flipped, a tensor dropped
or one left over from an update that did not finish shows up as a named difference.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["PROBE_PREFIX", "tensor_crc", "ReceivedWeights"]

PROBE_PREFIX = "weight-probe-"
"""Request ids of the weight-sync probe: a paused replica serves them (the probe checks the
update the pause was for, before the paused requests resume)."""


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32 of ``t``'s raw bytes (C-contiguous, on the CPU; any dtype)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class ReceivedWeights:
    """The checksums of one replica's updates: :meth:`track` wraps what the replica loads;
    :attr:`last` is ``{name: crc32}`` of the last complete update."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        """Checksums of the last update whose final tensor arrived."""
        self._open: dict[str, int] | None = None

    def begin(self) -> None:
        """Start a new update (its first bucket)."""
        self._open = {}

    def track(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``items`` unchanged, recording each tensor's checksum in the open update."""
        if self._open is None:
            self._open = {}
        for name, t in items:
            self._open[name] = tensor_crc(t)
            yield name, t

    def end(self) -> None:
        """The update's last tensor arrived: it becomes :attr:`last`."""
        self.last, self._open = self._open or {}, None
