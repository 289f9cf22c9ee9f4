"""Building the roles of a run — worker groups, rollout engines, reward loop — from the config.

The trainer talks to :class:`Roles` only; which backend (``local`` or ``ray``) hosts the
workers and how weights reach the rollout engine are decided here, once.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from postrl.config import PostRLConfig
from postrl.engine.minibatch import pad_masked_rows
from postrl.protocol import DataProto
from postrl.reward import RewardLoop, RewardRequest, RewardResult

logger = logging.getLogger(__name__)

__all__ = ["Roles", "TrainerRewards", "build_roles", "resolve_fuse_old_log_prob"]


class TrainerRewards:
    """The trainer's view of the reward loop: streaming submission plus batch completion."""

    def __init__(self, loop: RewardLoop) -> None:
        self.loop = loop

    def can_stream(self, data_source: str) -> bool:
        """True when ``data_source`` is scored per sample (so it can start before the batch ends)."""
        return not self.loop.route(str(data_source)).batch

    def has_function(self, data_source: str) -> bool:
        """Whether a rule/custom function scores ``data_source`` (else only a reward model can)."""
        return self.loop.has_function(str(data_source))

    def submit(self, request: RewardRequest) -> Future:
        return self.loop.submit(request)

    def finish(self, batch: DataProto, futures: dict[int, Future], tokenizer: Any) -> RewardResult:
        """Scores for every row of ``batch``: streamed futures where present, the rest scored now."""
        from postrl.trainer.stages import decode_responses

        nt = batch.non_tensor_batch
        n = len(batch)
        missing = [i for i in range(n) if i not in futures]
        if missing:
            texts = decode_responses(tokenizer, batch[missing])
            reqs = [
                RewardRequest(
                    str(nt["data_source"][i]),
                    texts[j],
                    nt["ground_truth"][i],
                    dict(nt["extra_info"][i] or {}),
                    nt["uid"][i],
                )
                for j, i in enumerate(missing)
            ]
            rest = self.loop.score(reqs)
        samples: list[Any] = [None] * n
        if futures:
            order = sorted(futures)
            streamed = self.loop.gather([futures[i] for i in order])
            for j, i in enumerate(order):
                samples[i] = _sample_of(streamed, j)
        for j, i in enumerate(missing):
            samples[i] = _sample_of(rest, j)
        return RewardResult.from_samples(samples, list(nt["uid"]))

    def check_failures(self, result: RewardResult) -> None:
        self.loop.check_failures(result)

    def close(self) -> None:
        self.loop.close()


def _sample_of(result: RewardResult, j: int) -> Any:
    from postrl.reward import SampleScore

    extra = {k: v[j] for k, v in result.extra.items() if v[j] is not None}
    if bool(result.valid[j]):
        return SampleScore(float(result.scores[j]), None, None, extra)
    return SampleScore(None, result.failure_reason[j], result.failure_detail[j], extra)


@dataclass
class Roles:
    """Worker groups + rollout + reward of one run, behind the calls the step makes."""

    cfg: PostRLConfig
    actor: Any
    rollout: Any
    agent_manager: Any
    reward_loop: TrainerRewards
    ref: Any = None
    critic: Any = None
    reward_model: Any = None
    """Worker group of ``RewardModelWorker`` when ``reward.model.enable`` (else None)."""
    dp_size: int = 1
    use_lora_ref: bool = False
    fuse_old_log_prob: bool = False
    """Old log-probs come from the actor update's own forward (``actor.fuse_old_log_prob`` resolved)."""
    extra_close: list[Any] = field(default_factory=list)
    fused_old_log_probs: Any = None
    """(B, R) old log-probs the last fused update computed (None when not fused)."""

    # --- stages ---------------------------------------------------------------------
    def balance(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        from postrl.controller import balance_for_dp

        return balance_for_dp(batch, self.dp_size)

    def old_log_probs(self, batch: DataProto, metrics: dict[str, Any]) -> DataProto:
        """Stage 4: recompute old log-probs (or reuse rollout ones in bypass mode)."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            return batch.union(
                DataProto.from_dict({"old_log_probs": batch.batch["rollout_log_probs"]})
            )
        batch.meta_info["calculate_entropy"] = True
        out = self.actor.compute_log_prob(batch)
        if "entropys" in out.batch:
            ent, mask = out.batch.pop("entropys"), batch.batch["response_mask"].float()
            metrics["actor/entropy_old"] = (ent * mask).sum() / mask.sum().clamp(min=1)
        return batch.union(out.select(["old_log_probs"], [], []))

    def ref_log_probs(self, batch: DataProto) -> DataProto:
        if self.use_lora_ref:
            return self.actor.compute_ref_log_prob(batch)
        return self.ref.compute_ref_log_prob(batch)

    def values(self, batch: DataProto) -> DataProto:
        return self.critic.compute_values(batch)

    def rm_scores(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """Stage 2 (with ``reward.model.enable``): raw reward-model scores (B,) and their metrics."""
        out = self.reward_model.compute_rm_score(batch)
        scores = out.batch["rm_scores"].float()
        cut = out.batch["rm_truncated"]
        metrics = {
            "reward_model/score/mean": float(scores.mean()),
            "reward_model/score/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward_model/truncated": float(cut.sum()),
        }
        if bool(cut.any()):
            logger.warning(
                "reward model: %d of %d conversations exceeded reward.model.max_length=%d and kept their last "
                "tokens",
                int(cut.sum()),
                len(cut),
                self.cfg.reward.model.max_length,
            )
        return scores, metrics

    def update_actor(self, batch: DataProto) -> dict[str, float]:
        """Stage 7: one actor update; metrics of rank 0 (identical on every rank after all-reduce).

        A fused update (batch without ``old_log_probs``) leaves the old log-probs it computed in
        :attr:`fused_old_log_probs`, row-aligned with ``batch``.
        """
        out = self.actor.update_actor(pad_masked_rows(batch, self.dp_size))
        self.fused_old_log_probs = None
        if isinstance(out, DataProto) and "old_log_probs" in out.batch:
            self.fused_old_log_probs = out.batch["old_log_probs"][: len(batch)]
        return _metrics_of(out)

    def update_critic(self, batch: DataProto) -> dict[str, float]:
        """Stage 7: one critic update (padding rows masked, as for the actor)."""
        return _metrics_of(self.critic.update_critic(pad_masked_rows(batch, self.dp_size)))

    def sync_weights(self) -> None:
        """Stream the actor's weights into the rollout engines (one tensor/bucket at a time)."""
        self.rollout.push_weights(self.actor)

    # --- checkpoints ------------------------------------------------------------------
    def save(self, ckpt_dir: Path) -> None:
        self.actor.save_checkpoint(str(ckpt_dir / "actor"))
        if self.critic is not None:
            self.critic.save_checkpoint(str(ckpt_dir / "critic"))

    def load(self, ckpt_dir: Path) -> None:
        self.actor.load_checkpoint(str(ckpt_dir / "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(ckpt_dir / "critic"))

    def close(self) -> None:
        for obj in (self.actor, self.ref, self.critic, self.reward_model, *self.extra_close):
            if obj is not None and hasattr(obj, "shutdown"):
                obj.shutdown()
        if hasattr(self.rollout, "close"):
            self.rollout.close()
        self.reward_loop.close()


def _metrics_of(out: Any) -> dict[str, float]:
    if isinstance(out, DataProto):
        return dict(out.meta_info.get("metrics", {}))
    if isinstance(out, list):  # one dict per collected rank: identical after all-reduce
        return dict(out[0])
    return dict(out)


def kv_capacity(cfg: PostRLConfig, multi_turn: bool) -> int:
    """Tokens per KV slot: prompt + response, plus the agent-turn allowances only for multi-turn
    loops (an oversized cache costs real memory traffic on every wake-up)."""
    r = cfg.rollout
    if r.max_model_len:
        return r.max_model_len
    if not multi_turn:
        return cfg.data.max_prompt_length + r.response_length
    a = r.agent
    return (
        cfg.data.max_prompt_length
        + r.response_length * max(1, a.max_assistant_turns)
        + a.max_tool_response_length * a.max_user_turns
    )


def build_roles(
    cfg: PostRLConfig, total_steps: int, *, use_ref: bool, use_critic: bool, multi_turn: bool = True
) -> Roles:
    """Create worker groups on ``trainer.backend``, the rollout engine(s) and the reward loop."""
    from postrl.agent import AgentLoopManager
    from postrl.controller import create_worker_group
    from postrl.data import load_tokenizer
    from postrl.rollout import LoadBalancer, RolloutClient, RolloutReplica, create_rollout_backend
    from postrl.workers import ActorWorker, CriticWorker, RefWorker, RewardModelWorker

    tc = cfg.trainer
    dp = tc.num_workers if tc.backend == "ray" else 1
    common = dict(world_size=dp, init_dist=dp > 1) if tc.backend == "ray" else dict(world_size=1)
    kwargs = {"cfg": cfg, "total_steps": total_steps}
    actor = create_worker_group(tc.backend, ActorWorker, kwargs=kwargs, name="actor", **common)
    use_lora_ref = use_ref and cfg.model.lora_rank > 0
    ref = None
    if use_ref and not use_lora_ref:
        ref = create_worker_group(tc.backend, RefWorker, kwargs=kwargs, name="ref", **common)
    critic = (
        create_worker_group(tc.backend, CriticWorker, kwargs=kwargs, name="critic", **common)
        if use_critic
        else None
    )
    rm = (
        create_worker_group(
            tc.backend, RewardModelWorker, kwargs=kwargs, name="reward_model", **common
        )
        if cfg.reward.model.enable
        else None
    )

    r = cfg.rollout
    max_len = kv_capacity(cfg, multi_turn)
    options: dict[str, Any] = dict(
        max_num_seqs=r.max_num_seqs, max_model_len=max_len, device=tc.device
    )
    options.update(r.engine_kwargs)
    replicas = [
        RolloutReplica(create_rollout_backend(r.backend, cfg.model.path, **options), replica_id=i)
        for i in range(r.num_replicas)
    ]
    fleet = RolloutFleet(replicas, cfg.rollout.weight_sync, remote_actor=tc.backend == "ray")
    client = RolloutClient(LoadBalancer(replicas))
    tokenizer = load_tokenizer(cfg.model.path)
    manager = AgentLoopManager(client, tokenizer, r.agent, max_model_len=max_len)
    rw = cfg.reward
    reward = RewardLoop(
        timeout_s=rw.timeout_s,
        num_workers=rw.num_workers,
        custom_fn_path=rw.custom_function.path or None,
        custom_fn_name=rw.custom_function.name,
        custom_fn_batch=rw.custom_function.batch,
        fn_kwargs=rw.reward_kwargs,
        max_failure_ratio=rw.max_failure_ratio,
        isolate_builtin=rw.isolate_builtin,
    )
    return Roles(
        cfg,
        actor,
        fleet,
        manager,
        TrainerRewards(reward),
        ref=ref,
        critic=critic,
        reward_model=rm,
        dp_size=dp,
        use_lora_ref=use_lora_ref,
        fuse_old_log_prob=resolve_fuse_old_log_prob(cfg),
    )


def resolve_fuse_old_log_prob(cfg: PostRLConfig) -> bool:
    """``actor.fuse_old_log_prob`` resolved: None = on exactly when nothing blocks it."""
    from postrl.config.validate import old_log_prob_fusion_blockers

    setting = cfg.actor.fuse_old_log_prob
    return not old_log_prob_fusion_blockers(cfg) if setting is None else bool(setting)


class RolloutFleet:
    """All rollout replicas of a run, driven together (wake/sleep/weights).

    Weights reach the replicas through the configured ``rollout.weight_sync`` backend. When the
    actor lives in other processes (Ray), it ships raw-byte bucket frames (JSON header + bytes,
    never pickled) that each replica unpacks.
    """

    def __init__(self, replicas: list[Any], weight_sync: str, remote_actor: bool) -> None:
        from postrl.weights import create_weight_sync

        self.replicas = replicas
        self.remote_actor = remote_actor
        self.sync = create_weight_sync(weight_sync)
        self.version = 0

    def wake_up(self) -> None:
        for r in self.replicas:
            r.wake_up()

    def sleep(self) -> None:
        for r in self.replicas:
            r.sleep()

    def push_weights(self, actor: Any) -> None:
        """Deliver the actor's current weights to every replica; bumps the policy version."""
        self.version += 1
        if self.remote_actor:
            frames = actor.get_weight_frames()
            frames = frames[0] if frames and isinstance(frames[0], list) else frames
            for frame in frames:
                for r in self.replicas:
                    r.receive_bucket(frame)
            return
        self.sync.sync(actor.get_per_tensor_param(), self.replicas)

    def close(self) -> None:
        for r in self.replicas:
            if hasattr(r.backend, "close"):
                r.backend.close()
