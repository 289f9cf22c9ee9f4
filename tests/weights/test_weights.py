"""Bucketed weight streaming: exact round trip, bounded buckets, lazy consumption, == reload."""

from __future__ import annotations

import asyncio
import struct

import pytest
import torch

from postrl.rollout import SamplingParams, create_rollout_backend
from postrl.weights import (
    WEIGHT_SYNC_BACKENDS,
    FrameStream,
    create_weight_sync,
    decode_frame,
    encode_frame,
    pack_buckets,
    unpack_bucket,
    unpack_stream,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, 7, generator=g)),
        ("b", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.int64)),
        ("scalar", torch.tensor(3.5)),
        ("big", torch.randn(300, generator=g)),  # 1200 bytes > bucket: travels alone
        ("d", torch.randn(4, 4, generator=g).t()),  # non-contiguous
        ("e", torch.ones(3, dtype=torch.float16)),
    ]


def test_roundtrip_exact_through_frames():
    src = _tensors()
    frames = [encode_frame(b) for b in pack_buckets(iter(src), bucket_bytes=512, version=7)]
    out = list(unpack_stream(decode_frame(f) for f in frames))
    assert [n for n, _ in out] == [n for n, _ in src]
    for (_, a), (_, b) in zip(src, out):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    headers = [decode_frame(f).header for f in frames]
    assert (
        headers[-1]["last"]
        and not any(h["last"] for h in headers[:-1])
        and headers[0]["version"] == 7
    )


def test_buckets_bounded_and_stream_consumed_lazily():
    """Peak memory bound: each bucket holds <= bucket_bytes (an oversized tensor travels alone),
    and the sender has pulled at most one tensor beyond the bucket it is delivering."""
    bucket = 256
    pulled = []

    def gen():
        for i in range(40):
            pulled.append(i)
            yield (
                f"t{i}",
                torch.full((i % 9 + 1,) if i != 20 else (200,), float(i)),
            )  # t20 = 800 bytes

    seen = 0
    for b in pack_buckets(gen(), bucket_bytes=bucket):
        names = [e["name"] for e in b.header["tensors"]]
        assert b.nbytes <= bucket or names == ["t20"]
        seen += len(names)
        assert len(pulled) <= seen + 1  # lazy: nothing read ahead beyond the one pending tensor
        for name, t in unpack_bucket(b):
            assert torch.all(t == float(name[1:]))
    assert seen == 40


def test_malformed_frames_rejected():
    with pytest.raises(ValueError, match="shorter"):
        decode_frame(b"abc")
    with pytest.raises(ValueError, match="header length"):
        decode_frame(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="not JSON"):
        decode_frame(struct.pack("<Q", 3) + b"{x}")
    bad = encode_frame(next(pack_buckets([("a", torch.zeros(2))], 64)))
    b = decode_frame(bad)
    b.header["tensors"][0]["nbytes"] = 4096
    with pytest.raises(ValueError, match="outside payload"):
        unpack_bucket(b)


@pytest.mark.parametrize("frames", [False, True], ids=["tensors", "frames"])
@pytest.mark.parametrize("name", ["naive", "bucketed"])
def test_sync_into_engine_equals_reload(tiny_model_factory, name, frames):
    """Both backends, from the in-process tensor stream and from encoded frames (the Ray
    actor's stream), load exactly the weights a fresh engine reads from disk."""
    from safetensors.torch import load_file

    d0, d1 = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    be = create_rollout_backend("native", d0, max_num_seqs=4, max_model_len=64)
    fresh = create_rollout_backend("native", d1, max_num_seqs=4, max_model_len=64)
    new = load_file(str(d1 / "model.safetensors"))
    sync = create_weight_sync(name, **({"bucket_bytes": 100_000} if name == "bucketed" else {}))
    tensors = iter(sorted(new.items()))
    source = tensors
    if frames:  # what the Ray actor sends: frames of 100 kB buckets, pulled one at a time
        pulled: list[int] = []

        def frame_iter():
            for b in pack_buckets(tensors, 100_000, version=7):
                pulled.append(b.nbytes)
                yield encode_frame(b)

        source = FrameStream(frame_iter())
    stats = sync.sync_weights(source, [be], version=7)
    assert stats.num_tensors == len(new) and stats.version == 7
    assert stats.metrics()["weights/tensors"] == len(new)
    if frames:
        assert len(pulled) == stats.num_buckets > 5  # every frame pulled exactly once
    if name == "bucketed":
        largest = max(
            t.numel() * t.element_size() for t in new.values()
        )  # oversized ones travel alone
        assert stats.num_buckets > 5 and stats.max_bucket_bytes <= max(100_000, largest)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)

    async def both():
        return await be.generate([5, 6, 7], sp, "a"), await fresh.generate([5, 6, 7], sp, "b")

    a, b = asyncio.run(both())
    assert a.token_ids == b.token_ids and a.log_probs == b.log_probs


def test_registry():
    assert {"naive", "bucketed", "nccl"} <= set(WEIGHT_SYNC_BACKENDS.names())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            create_weight_sync("nccl")


def test_a_shared_buffer_bucket_maps_back_to_the_same_tensors(tmp_path):
    from postrl.weights.buckets import SharedWeightBuffer, map_shared_bucket

    torch.manual_seed(0)
    weights = {f"w{i}": torch.randn(100 + i, 7) for i in range(5)}
    shared = SharedWeightBuffer(tmp_path / "w.buf", 1 << 14)
    buckets, maps, mapped, count = [], {}, set(), 0
    for b in pack_buckets(iter(weights.items()), 1 << 13, version=3, buffer=shared.tensor):
        off = shared.offset_of(b.payload)
        assert off == 0  # every bucket starts at the buffer's start
        other = map_shared_bucket(b.header, shared.path, off, b.nbytes, maps)  # another mapping
        mapped.add(other.payload.data_ptr())
        buckets += [(n, t.clone()) for n, t in unpack_bucket(other)]
        count += 1
    assert count == 3 and len(mapped) == 1 and len(maps) == 1  # mapped once, reused
    assert [n for n, _ in buckets] == list(weights)
    for n, t in buckets:
        assert torch.equal(t, weights[n])
    assert shared.offset_of(torch.zeros(8, dtype=torch.uint8)) is None  # lies elsewhere
    with pytest.raises(ValueError, match="outside"):
        map_shared_bucket({"tensors": []}, shared.path, (1 << 14) - 4, 8)
    with pytest.raises(ValueError, match="buffer of"):
        next(pack_buckets(iter(weights.items()), 1 << 15, buffer=shared.tensor))
