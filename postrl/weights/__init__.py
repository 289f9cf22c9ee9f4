"""postrl.weights — weight sync from the actor's per-tensor stream into rollout engines.

Registry ``WEIGHT_SYNC_BACKENDS``: ``naive`` (in-process), ``bucketed`` (fixed-size byte
buckets, raw bytes + JSON header, never pickled), ``nccl`` (GPU, imported lazily).
"""

from postrl.weights.buckets import (
    Bucket,
    SharedWeightBuffer,
    decode_frame,
    encode_frame,
    pack_buckets,
    send_frames,
    unpack_bucket,
    unpack_stream,
)
from postrl.weights.sync import (
    WEIGHT_SYNC_BACKENDS,
    BucketedSync,
    FrameStream,
    NaiveSync,
    SyncStats,
    WeightReceiver,
    WeightSource,
    WeightSync,
    create_weight_sync,
    register_weight_sync,
)

__all__ = [
    "Bucket",
    "SharedWeightBuffer",
    "decode_frame",
    "encode_frame",
    "pack_buckets",
    "send_frames",
    "unpack_bucket",
    "unpack_stream",
    "WEIGHT_SYNC_BACKENDS",
    "BucketedSync",
    "FrameStream",
    "NaiveSync",
    "SyncStats",
    "WeightReceiver",
    "WeightSource",
    "WeightSync",
    "create_weight_sync",
    "register_weight_sync",
]
