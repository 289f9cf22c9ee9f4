"""``TeacherWorker``: a frozen teacher model scoring the student's sampled tokens
(on-policy distillation, ``distill.teacher_path``).

Built like :class:`~postrl.workers.actor.RefWorker` — same backend, dp size and sharding
strategy (``actor.strategy``), log-probs only, no optimizer — but from ``distill.teacher_path``
and always without LoRA. Log-probs are at temperature 1 (the teacher's own distribution),
whatever the rollout temperature: the student is pulled towards the teacher, not towards a
tempered copy of it.

=========================  ======================  =========================================
method                     dispatch                returns
=========================  ======================  =========================================
compute_teacher_log_prob   DP_COMPUTE_PROTO        DataProto ``teacher_log_prob`` (B, R)
                                                   [+ ``teacher_topk_log_probs`` / ``_ids``
                                                   (B, R, K), K = ``distill.topk``, when the
                                                   loss needs ``teacher_topk``: gkd]
=========================  ======================  =========================================

The top-k comes from the same forward as ``teacher_log_prob`` (one more ``topk`` over each
(chunk, V) logits block, no further (B, R, V) tensor): the K largest normalised log-probs of the
teacher's next-token distribution at each response position, sorted, and their token ids.
"""

from __future__ import annotations

from postrl.controller import Dispatch, Worker, register
from postrl.engine.actor import LogProbEngine
from postrl.engine.model import load_policy
from postrl.protocol import DataProto
from postrl.workers.common import batch_spec, model_spec, setup, shard_if, share_prefix

__all__ = ["TeacherWorker", "teacher_topk"]


class TeacherWorker(Worker):
    """A frozen teacher computing ``teacher_log_prob`` of the responses in a batch."""

    def __init__(self, cfg, total_steps: int = 0) -> None:
        self.cfg = cfg
        self.dev, self.group = setup(cfg)
        spec = model_spec(cfg.model, path=cfg.distill.teacher_path, lora_rank=0)
        self.policy = load_policy(spec, self.dev, trainable=False)
        shard_if(cfg.actor.strategy, self.policy, self.group, self.dev)
        self.engine = LogProbEngine(  # frozen: log-probs only
            self.policy, batch_spec(cfg.actor), share_prefix=share_prefix(cfg), device=self.dev
        )
        self.topk = teacher_topk(cfg)
        self.register_dp_info("teacher", dp_rank=self.rank, dp_size=self.world_size)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """``teacher_log_prob`` (B, R) of ``responses`` under the teacher (temperature 1), and
        its top-k (``teacher_topk_log_probs``, ``teacher_topk_ids`` (B, R, K)) when the loss
        needs it."""
        meta = {**data.meta_info, "temperature": 1.0, "calculate_topk": self.topk}
        meta.pop("calculate_entropy", None)
        meta.pop("calculate_sum_pi_squared", None)
        out = self.engine.compute_log_prob(DataProto(data.batch, data.non_tensor_batch, meta))
        cols = {"teacher_log_prob": out.batch["old_log_probs"]}
        if self.topk:
            cols["teacher_topk_log_probs"] = out.batch["topk_log_probs"]
            cols["teacher_topk_ids"] = out.batch["topk_ids"]
        return DataProto.from_dict(cols)


def teacher_topk(cfg) -> int:
    """K of the teacher's top-k: ``distill.topk`` when the configured ``distill.loss`` declares
    the need ``teacher_topk`` (gkd), else 0 (the sampled tokens' log-probs only)."""
    from postrl.algos.distill import DISTILL_LOSSES

    d = cfg.distill
    if not d.enabled or d.loss not in DISTILL_LOSSES:
        return 0
    return int(d.topk) if "teacher_topk" in DISTILL_LOSSES.meta(d.loss).get("needs", ()) else 0
