"""The weight-sync contract, sending half: what a sync sent, tensor by tensor, and how it compares
with what a replica loaded.

:func:`checksummed` wraps a weight source (the actor's per-tensor stream or a
:class:`~postrl.weights.sync.FrameStream`) so that the CRC-32 of every tensor's bytes is recorded
as it leaves (``expected``); each replica records the same over what it loaded
(``postrl.rollout.checksum``). :func:`transport_mismatches` names every tensor that differs, is
missing or was not sent. The functional half (an engine's log-probs of a probe sequence against
the trainer's) and the resend-once policy live with the trainer (``trainer/weight_check.py``).

Fault injection (tests only): a callable in :data:`TRANSPORT_FAULTS` sees each ``(name, tensor)``
after its checksum was taken and may return a replacement (corruption in transit); the library
installs none.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from postrl.rollout.checksum import tensor_crc
from postrl.weights.sync import FrameStream

__all__ = [
    "TRANSPORT_FAULTS",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "checksummed",
    "transport_mismatches",
]

TransportFault = Callable[[str, torch.Tensor], "torch.Tensor | None"]
TRANSPORT_FAULTS: list[TransportFault] = []
"""Test hooks run on every sent tensor after its checksum (a returned tensor replaces it)."""


class WeightSyncError(RuntimeError):
    """A weight sync failed its contract (after the resend): ``engine`` names the replica and
    backend, ``problems`` the tensors or probe tokens that differ."""

    def __init__(self, engine: str, problems: list[str]) -> None:
        shown = "; ".join(problems[:8]) + (
            f"; … {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        super().__init__(
            f"weight sync into {engine} failed verification twice (sent, then resent once): "
            f"{shown}. The engine does not hold the trainer's weights; nothing generated from "
            f"them was trained. Check the weight-sync backend (rollout.weight_sync) and the "
            f"engine's weight loading; rollout.verify_weights=false turns the check off."
        )
        self.engine = engine
        self.problems = problems


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A weight sync did not finish within its deadline (``rollout.weight_sync_timeout_s``)."""

    def __init__(self, engine: str, timeout_s: float) -> None:
        RuntimeError.__init__(
            self,
            f"weight sync into {engine} did not finish within {timeout_s}s "
            f"(rollout.weight_sync_timeout_s); the replica or the weight source is stuck",
        )
        self.engine = engine
        self.problems = [f"timeout after {timeout_s}s"]


def _faulted(name: str, t: torch.Tensor) -> torch.Tensor:
    for fault in tuple(TRANSPORT_FAULTS):
        out = fault(name, t)
        if out is not None:
            t = out
    return t


def _tensors(
    weights: Iterable[tuple[str, torch.Tensor]], expected: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        expected[name] = tensor_crc(t)
        yield name, (_faulted(name, t) if TRANSPORT_FAULTS else t)


def _frame_crcs(frame: bytes, expected: dict[str, int]) -> bytes:
    """Record the checksum of every tensor in one bucket frame (from its bytes, no copy); with a
    fault installed, the frame is rebuilt with the fault's tensors."""
    mv = memoryview(frame)
    (hlen,) = struct.unpack("<Q", mv[:8])
    header = json.loads(bytes(mv[8 : 8 + hlen]))
    base = 8 + hlen
    for e in header.get("tensors", ()):
        off, n = base + int(e["offset"]), int(e["nbytes"])
        expected[e["name"]] = zlib.crc32(mv[off : off + n])
    if not TRANSPORT_FAULTS:
        return frame
    from postrl.weights.buckets import Bucket, decode_frame, encode_frame, unpack_bucket

    bucket = decode_frame(frame)
    for name, t in unpack_bucket(bucket):
        new = _faulted(name, t)
        if new is not t:
            t.copy_(new)  # a view into the decoded payload
    return encode_frame(Bucket(bucket.header, bucket.payload))


def checksummed(source: Any, expected: dict[str, int]) -> Any:
    """``source`` with the CRC-32 of every tensor recorded into ``expected`` as it is sent (a
    per-tensor stream stays a stream, a :class:`FrameStream` stays one)."""
    if isinstance(source, FrameStream):
        return FrameStream(_frame_crcs(f, expected) for f in source.frames)
    return _tensors(source, expected)


def transport_mismatches(expected: dict[str, int], received: dict[str, int]) -> list[str]:
    """Every tensor whose received checksum differs from the sent one, that was sent and not
    received, or received and not sent — by name."""
    out = [
        f"tensor {n!r}: checksum {received[n]:08x} received, {c:08x} sent"
        for n, c in expected.items()
        if n in received and received[n] != c
    ]
    out += [f"tensor {n!r}: sent, never loaded" for n in expected if n not in received]
    out += [
        f"tensor {n!r}: loaded, never sent in this update" for n in received if n not in expected
    ]
    return out
