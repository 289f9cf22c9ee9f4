"""Policy roles on the single controller: ``ActorWorker`` and ``RefWorker``
(:mod:`postrl.workers.critic` and :mod:`postrl.workers.reward_model` hold the other roles).

Each is constructed from the full ``PostRLConfig`` (``cfg=``, ``total_steps=`` optimizer-step
count for cosine schedules). Data-parallel ranks (Ray backend, ``init_dist``) share the model
over the default process group as ``actor.strategy`` / ``critic.strategy`` says: ``fsdp2``
(default) shards it with FSDP2 (:mod:`postrl.engine.fsdp`; the reference model follows
``actor.strategy``), ``ddp`` trains replicas and sums gradients (:mod:`postrl.engine.optim`).

With ``fsdp2`` every method that gathers weights is a collective, so the weight stream and
``save_checkpoint`` run on every rank (rank 0's result is returned / rank 0 writes), and the
in-process iterator ``get_per_tensor_param`` refuses to run on a sharded group.

=========================  ======================  =========================================
method                     dispatch                returns
=========================  ======================  =========================================
compute_log_prob           DP_COMPUTE_PROTO        DataProto ``old_log_probs`` (+``entropys``)
compute_ref_log_prob       DP_COMPUTE_PROTO        DataProto ``ref_log_prob``
update_actor               DP_COMPUTE_PROTO        DataProto with ``meta_info['metrics']``
get_per_tensor_param       RANK_ZERO               iterator of (HF name, tensor)
open_weight_stream         ONE_TO_ALL              starts a bucket-frame stream on every rank
next_weight_frame          ALL_RANKS_RANK0_OUT     rank 0's next raw-byte frame (None: end)
save/load_checkpoint       ONE_TO_ALL              every rank gathers, rank 0 writes; all load
shard_stats                ONE_TO_ALL              per rank parameter counts, dummy passes
compute_values             DP_COMPUTE_PROTO        DataProto ``values``
update_critic              DP_COMPUTE_PROTO        DataProto with ``meta_info['metrics']``
=========================  ======================  =========================================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from postrl.controller import Dispatch, Execute, Worker, register
from postrl.engine.actor import Actor, LogProbEngine
from postrl.engine.checkpoint import iter_hf_params, load_engine_checkpoint, save_engine_checkpoint
from postrl.engine.fsdp import param_numel
from postrl.engine.model import load_policy
from postrl.protocol import DataProto
from postrl.workers.common import (
    ALL_RANKS_RANK0_OUT,
    LendsCores,
    barrier,
    batch_spec,
    metrics_proto,
    model_spec,
    optim_spec,
    policy_loss_spec,
    setup,
    shard_if,
    share_prefix,
)

logger = logging.getLogger(__name__)

__all__ = ["ActorWorker", "RefWorker"]


class ActorWorker(LendsCores, Worker):
    """The policy: log-probs, PPO update, weight stream, checkpoints (and LoRA reference)."""

    def __init__(self, cfg, total_steps: int = 0) -> None:
        self.cfg = cfg
        self.dev, self.group = setup(cfg)
        self.policy = load_policy(model_spec(cfg.model), self.dev)
        shard_if(cfg.actor.strategy, self.policy, self.group, self.dev)
        self.actor = Actor(
            self.policy,
            batch=batch_spec(cfg.actor),
            loss=policy_loss_spec(cfg.actor, cfg.distill),
            optim=optim_spec(cfg.actor.optim),
            rollout_n=cfg.train_group_size,
            share_prefix=share_prefix(cfg),
            device=self.dev,
            group=self.group,
            total_steps=total_steps,
            seed=cfg.trainer.seed,
        )
        self.register_dp_info("actor", dp_rank=self.rank, dp_size=self.world_size)

    def _lending_model(self) -> torch.nn.Module:
        return self.policy.module

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` (B, R) with the current policy (temperature from meta_info).

        Rows by reference (``meta_info["by_ref"]``, ``protocol/refs.py``): the answer stays on
        this side, so the entropy's mean over this shard's policy tokens is reported in
        ``meta_info["local"]`` (``actor/entropy_old``) instead of the ``entropys`` column."""
        with self._compute():
            out = self.actor.compute_log_prob(data)
        if data.meta_info.get("by_ref") and "entropys" in out.batch:
            ent, mask = out.batch.pop("entropys"), data.batch["response_mask"].float()
            entropy = float((ent * mask).sum() / mask.sum().clamp(min=1))
            out.meta_info["local"] = {"actor/entropy_old": entropy}
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` from this model with LoRA adapters disabled (LoRA runs only)."""
        with self._compute():
            return self.actor.compute_log_prob(data, reference=True)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update on this rank's shard; metrics in ``meta_info['metrics']``.

        When ``data`` has no ``old_log_probs`` (fused on-policy update) the output also carries
        the ``old_log_probs`` the update computed, row-aligned with ``data``.

        Rows by reference (``protocol/refs.py``) bring stage 6's rollout correction with them
        (``meta_info["rollout_correction"]``: its keyword arguments, since the log-probs it
        reads stay on the workers): it runs here, before the update, or after a fused one on
        the update's own old log-probs (its metrics only); the shard's correction, health and
        fetch metrics come back in ``meta_info["local"]``.
        """
        local = dict(data.meta_info.get("timing", {}))
        rc = data.meta_info.get("rollout_correction")
        if rc is not None and "old_log_probs" in data.batch:
            data = _corrected(data, rc, local)
        t0 = time.perf_counter()
        lent: dict[str, float] = {}
        with self._compute(lent, "actor/cores_borrowed_s"):
            out = self.actor.update_policy(data)
        out.metrics.update(lent)
        if rc is not None and out.old_log_probs is not None:  # fused: measured on its own pass
            data.batch["old_log_probs"] = out.old_log_probs[: len(data)]
            if out.trained is not None:  # only the rows it ran have them
                data.batch["response_mask"] = data.batch["response_mask"] * out.trained[:, None]
            _corrected(data, rc, local)
        if data.meta_info.get("by_ref"):
            local["timing_s/update_policy"] = time.perf_counter() - t0
            return DataProto(meta_info={"metrics": out.metrics, "local": local})
        if out.old_log_probs is None:
            return metrics_proto(out.metrics)
        got = {"old_log_probs": out.old_log_probs}
        if out.trained is not None:
            got["update_trained"] = out.trained
        return DataProto.from_dict(got, meta_info={"metrics": out.metrics})

    @register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.RANK_ZERO)
    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time (an iterator: in-process backends only)."""
        if self.policy.dp_group is not None:
            raise RuntimeError(
                "get_per_tensor_param runs on rank 0 only, but the model is FSDP2-sharded over "
                f"{self.world_size} ranks (gathering needs all of them): "
                "use open_weight_stream / next_weight_frame"
            )
        return iter_hf_params(self.policy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_stream(self, bucket_bytes: int = 64 << 20, version: int | None = None) -> None:
        """Start streaming the weights as raw-byte bucket frames (JSON header + tensor bytes,
        never pickled) for rollout engines in another process (Ray backend); each
        :meth:`next_weight_frame` call then moves one bucket, so only one crosses at a time.

        Runs on every rank: with FSDP2 each parameter is all-gathered in turn (all ranks take
        part, in lockstep, bucket by bucket); only rank 0 returns frames.
        """
        from postrl.weights import encode_frame, pack_buckets

        def frames() -> Iterator[bytes]:
            for bucket in pack_buckets(iter_hf_params(self.policy), bucket_bytes, version=version):
                yield encode_frame(bucket) if self.rank == 0 else b""

        self._weight_stream: Iterator[bytes] | None = frames()

    @register(dispatch_mode=ALL_RANKS_RANK0_OUT)
    def next_weight_frame(self) -> bytes | None:
        """The next bucket frame of the stream :meth:`open_weight_stream` opened (rank 0's),
        or None when the stream is exhausted (the stream is then closed)."""
        stream = getattr(self, "_weight_stream", None)
        if stream is None:
            raise RuntimeError("next_weight_frame called without open_weight_stream")
        frame = next(stream, None)
        if frame is None:
            self._weight_stream = None
        return frame

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_stats(self) -> dict[str, int]:
        """This rank's parameter elements (``local``; FSDP2: about ``full / dp``), the full
        model's (``full``) and the FSDP2 dummy passes run so far (``dummy_passes``)."""
        return {**param_numel(self.policy.module), "dummy_passes": self.policy.dummy_passes}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Write the checkpoint atomically: rank 0 writes full tensors (every rank takes part in
        the gathers of a sharded model; replicas hold identical state), or with
        ``trainer.checkpoint_format=sharded`` every FSDP2 rank writes its own shards."""
        save_engine_checkpoint(
            path,
            self.policy.module,
            self.actor.loop.optimizer,
            self.actor.loop.scheduler,
            model_cfg=model_spec(self.cfg.model),
            write=self.rank == 0,
            sharded=self.cfg.trainer.checkpoint_format == "sharded",
            extra={
                "update_count": self.actor.update_count,
                "nonfinite_skips": self.actor.loop.nonfinite_skips,
                "entropy_coeff": self.actor.entropy_coeff,
            },
        )
        barrier(self.group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimizer, scheduler, RNG and counters from ``path``."""
        extra = load_engine_checkpoint(
            path, self.policy.module, self.actor.loop.optimizer, self.actor.loop.scheduler
        )
        self.actor.update_count = int(extra.get("update_count", 0))
        self.actor.loop.nonfinite_skips = int(extra.get("nonfinite_skips", 0))
        self.actor.entropy_coeff = float(extra.get("entropy_coeff", self.actor.loss.entropy_coeff))


class RefWorker(Worker):
    """A frozen copy of the initial policy computing ``ref_log_prob``."""

    def __init__(self, cfg, total_steps: int = 0) -> None:
        self.cfg = cfg
        self.dev, self.group = setup(cfg)
        self.policy = load_policy(model_spec(cfg.model), self.dev, trainable=False)
        shard_if(cfg.actor.strategy, self.policy, self.group, self.dev)
        self.engine = LogProbEngine(  # a frozen model: log-probs only, no optimizer
            self.policy, batch_spec(cfg.actor), share_prefix=share_prefix(cfg), device=self.dev
        )
        self.register_dp_info("ref", dp_rank=self.rank, dp_size=self.world_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_stats(self) -> dict[str, int]:
        """Parameter elements on this rank / in the full model, FSDP2 dummy passes (see
        ActorWorker)."""
        return {**param_numel(self.policy.module), "dummy_passes": self.policy.dummy_passes}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R) under the reference policy."""
        out = self.engine.compute_log_prob(data)
        return DataProto.from_dict(
            {"ref_log_prob": out.batch["old_log_probs"]}, meta_info=out.meta_info
        )


def _corrected(data: DataProto, rc: dict[str, Any], local: dict[str, float]) -> DataProto:
    """Stage 6's rollout correction (``algos.rollout_correction_with_health``, as
    ``trainer/stages.py::rollout_correction_stage`` runs it on the driver plane) on this
    shard; its metrics into ``local``."""
    from postrl.algos import rollout_correction_with_health

    d = dict(data.batch)
    weights, d["response_mask"], cm = rollout_correction_with_health(
        d["old_log_probs"], d["rollout_log_probs"], d["response_mask"], **rc
    )
    if weights is not None:
        d["rollout_is_weights"] = weights
    local.update({k: float(v) for k, v in cm.items()})
    return DataProto(d, data.non_tensor_batch, data.meta_info)
