"""Pack a per-tensor weight stream into fixed-size byte buckets and back — no pickle.

Wire format of one bucket (a *frame*)::

    [8 bytes: little-endian uint64 header length H][H bytes: UTF-8 JSON header][payload bytes]

    header = {"format": "postrl-bucket/1", "index": i, "last": bool, "version": int | null,
              "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}

Tensors are laid out in the payload as their raw (C-contiguous, CPU) bytes at 16-byte-aligned
offsets.
``pack_buckets`` keeps one reusable payload buffer of ``bucket_bytes`` and pulls tensors from the
generator only as the current bucket fills, so sender-side peak memory is one bucket plus the
tensor being copied (a single tensor larger than the bucket travels alone in an oversized
bucket). ``unpack_bucket`` returns zero-copy views into the frame.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Bucket",
    "pack_buckets",
    "unpack_bucket",
    "unpack_stream",
    "encode_frame",
    "decode_frame",
    "SharedWeightBuffer",
    "map_shared_bucket",
]

FORMAT = "postrl-bucket/1"
_ALIGN = 16
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass
class Bucket:
    """One bucket: its JSON header and a uint8 payload tensor (``payload.numel()`` bytes)."""

    header: dict
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return int(self.payload.numel())


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack_buckets(
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = 64 << 20,
    version: int | None = None,
    buffer: torch.Tensor | None = None,
) -> Iterator[Bucket]:
    """Yield buckets of at most ``bucket_bytes`` payload bytes (one oversized tensor excepted).

    The yielded bucket's payload is a view of a reused buffer: consume it (send or unpack and
    copy) before asking for the next one. ``buffer``: a uint8 tensor of at least
    ``bucket_bytes`` to pack into (e.g. a :class:`SharedWeightBuffer`'s, which replica
    processes map), instead of a fresh one.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if buffer is not None and buffer.numel() < bucket_bytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes < bucket_bytes={bucket_bytes}")
    buf = buffer if buffer is not None else torch.empty(bucket_bytes, dtype=torch.uint8)
    entries: list[dict] = []
    used, index = 0, 0
    pending: tuple[str, torch.Tensor] | None = None
    it = iter(weights)
    while True:
        item = pending if pending is not None else next(it, None)
        pending = None
        if item is None:
            break
        name, t = item
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(
                f"tensor {name!r} has unsupported dtype {t.dtype}; supported: {sorted(_DTYPES)}"
            )
        n = t.numel() * t.element_size()
        start = -(-used // _ALIGN) * _ALIGN  # keep every tensor 16-byte aligned in the payload
        if used and start + n > bucket_bytes:  # flush, then retry this tensor
            yield Bucket(
                {
                    "format": FORMAT,
                    "index": index,
                    "last": False,
                    "version": version,
                    "tensors": entries,
                },
                buf[:used],
            )
            entries, used, index, pending = [], 0, index + 1, item
            continue
        if n > bucket_bytes:  # oversized: its own bucket, not copied into buf
            yield Bucket(
                {
                    "format": FORMAT,
                    "index": index,
                    "last": False,
                    "version": version,
                    "tensors": [
                        dict(name=name, dtype=dtype, shape=list(t.shape), offset=0, nbytes=n)
                    ],
                },
                _raw(t),
            )
            index += 1
            continue
        buf[start : start + n].copy_(_raw(t))
        entries.append(dict(name=name, dtype=dtype, shape=list(t.shape), offset=start, nbytes=n))
        used = start + n
    yield Bucket(
        {"format": FORMAT, "index": index, "last": True, "version": version, "tensors": entries},
        buf[:used],
    )


def unpack_bucket(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into ``bucket.payload`` (valid as long as the payload is)."""
    if bucket.header.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} bucket (format={bucket.header.get('format')!r})")
    out = []
    for e in bucket.header["tensors"]:
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ValueError(f"bucket tensor {e['name']!r}: unsupported dtype {e['dtype']!r}")
        off, n = int(e["offset"]), int(e["nbytes"])
        if off < 0 or off + n > bucket.nbytes:
            raise ValueError(
                f"bucket tensor {e['name']!r}: bytes [{off}, {off + n}) "
                f"outside payload of {bucket.nbytes}"
            )
        out.append((e["name"], bucket.payload[off : off + n].view(dtype).view(e["shape"])))
    return out


def unpack_stream(buckets: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten a bucket stream back into a lazy per-tensor stream."""
    for b in buckets:
        yield from unpack_bucket(b)


def encode_frame(bucket: Bucket) -> bytes:
    """Serialise a bucket as ``[u64 header length][JSON header][payload]`` (one copy of the
    payload)."""
    head = json.dumps(bucket.header, separators=(",", ":")).encode()
    return b"".join((struct.pack("<Q", len(head)), head, memoryview(bucket.payload.numpy())))


class SharedWeightBuffer:
    """A byte buffer in a file that processes on this machine map (``torch.from_file``,
    ``MAP_SHARED``): the trainer packs a bucket into it and a replica process reads the same
    pages, so a push sends only the bucket's header over the replica's socket (W1's 9.7 MB
    push: no payload copies through sockets and stream buffers).

    Args:
        path: the file (created, sized ``nbytes``; best on a tmpfs such as ``/dev/shm``).
        nbytes: its size (the sync's ``bucket_bytes``), reserved at once (``OSError`` when
            the file system has no room for it).
    """

    def __init__(self, path: str | Path, nbytes: int) -> None:
        self.path = str(path)
        self.nbytes = int(nbytes)
        with open(self.path, "wb") as f:  # reserved now: a full tmpfs fails here, not with
            os.posix_fallocate(f.fileno(), 0, self.nbytes)  # SIGBUS at the first write
        self.tensor = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def offset_of(self, payload: torch.Tensor) -> int | None:
        """Byte offset of ``payload`` in this buffer (None: it lies elsewhere, e.g. an oversized
        tensor's own bucket)."""
        base, ptr = self.tensor.data_ptr(), payload.data_ptr()
        if payload.dtype != torch.uint8 or not base <= ptr <= base + self.nbytes - payload.numel():
            return None
        return ptr - base


def map_shared_bucket(
    header: dict, path: str | Path, offset: int, nbytes: int, maps: dict | None = None
) -> Bucket:
    """The :class:`Bucket` a :class:`SharedWeightBuffer` holds at ``[offset, offset + nbytes)``
    (the receiving side; ``ValueError`` if that range is outside the file). ``maps``: a dict the
    caller keeps to reuse the file's mapping from one push to the next (its pages stay mapped:
    no page faults per push), remapped when the file changed."""
    st = Path(path).stat()
    size = st.st_size
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"shared bucket [{offset}, {offset + nbytes}) outside {path} ({size} B)")
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError("bucket header must be an object with a 'tensors' list")
    key, known = (st.st_ino, size), (maps or {}).get(str(path))
    if known is not None and known[0] == key:
        mapped = known[1]
    else:
        mapped = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        if maps is not None:
            maps[str(path)] = (key, mapped)
    return Bucket(header, mapped[offset : offset + nbytes])


def send_frames(
    weights: Iterable[tuple[str, torch.Tensor]],
    receive: Callable[[bytes], object],
    version: int | None = None,
    bucket_bytes: int = 64 << 20,
) -> None:
    """Pack a per-tensor weight stream into buckets of ``bucket_bytes`` and hand each, encoded
    as a frame (:func:`encode_frame`), to ``receive`` — one bucket in flight at a time (what a
    replica handle in another process does with ``update_weights``)."""
    for bucket in pack_buckets(weights, bucket_bytes, version=version):
        receive(encode_frame(bucket))


def decode_frame(frame: bytes | bytearray | memoryview, max_header: int = 16 << 20) -> Bucket:
    """Parse a frame produced by ``encode_frame`` (validates sizes; never unpickles)."""
    mv = memoryview(frame)
    if len(mv) < 8:
        raise ValueError("bucket frame shorter than its 8-byte header length")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if hlen > max_header or 8 + hlen > len(mv):
        raise ValueError(
            f"bucket frame header length {hlen} invalid for a frame of {len(mv)} bytes"
        )
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"bucket frame header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise ValueError("bucket frame header must be an object with a 'tensors' list")
    payload = (
        torch.frombuffer(bytearray(mv[8 + hlen :]), dtype=torch.uint8)
        if len(mv) > 8 + hlen
        else torch.empty(0, dtype=torch.uint8)
    )
    return Bucket(header, payload)
