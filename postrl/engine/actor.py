"""The policy engines: padding-free log-probs (:class:`LogProbEngine`) and the PPO/GRPO update
(:class:`Actor` = a log-prob engine + the shared :class:`~postrl.engine.update.UpdateLoop` with the
policy loss as its micro-batch loss).

Update (verl's ``update_policy``, with explicit global denominators):

    for epoch in range(ppo_epochs):
        for mini-batch (ppo_mini_batch_size × rollout.n responses, split over dp ranks):
            N_tok, N_seq = Σ_ranks valid tokens / non-empty rows of the mini-batch   (all-reduce)
            for micro-batch (token budget, Karmarkar–Karp balanced):
                L = pg_loss − c_H · agg(H) + c_KL · agg(KL(π‖π_ref))   (agg with N_tok, N_seq)
                    [+ c_D · agg(D_t): a loss-kind distillation term, e.g. gkd's JSD(β)]
                L.backward()                       # additive share of the mini-batch loss
            all-reduce(SUM) grads; clip; step unless the norm is non-finite (counted)

Rows whose ``response_mask`` is all zero (failed samples, filtered groups) are dropped inside each
mini-batch (:func:`postrl.engine.minibatch.split_mini_batches`): they contribute nothing to the
loss or the denominators, and every dp rank still runs the same mini-batches and collectives. A
mini-batch with no valid token on any rank is skipped (no optimizer step).

Settings are engine-owned dataclasses (:mod:`postrl.engine.specs`: ``BatchSpec``,
``PolicyLossSpec``, ``OptimSpec``); the role workers (:mod:`postrl.workers`) fill them from the
run's config.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from postrl.algos.aggregation import agg_loss
from postrl.algos.entropy import adapt_entropy_coeff
from postrl.algos.kl import kl_penalty
from postrl.algos.policy_losses import POLICY_LOSSES, LossInputs, bind_policy_loss
from postrl.engine.microbatch import make_micro_batches, restore_order
from postrl.engine.minibatch import split_mini_batches
from postrl.engine.model import PolicyModel
from postrl.engine.optim import allreduce_sum
from postrl.engine.specs import BatchSpec, OptimSpec, PolicyLossSpec
from postrl.engine.update import MicroLoss, UpdateLoop, rows_to_device
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["Actor", "LogProbEngine", "PolicyLossSpec", "PolicyUpdate", "prompt_groups"]


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group rows with identical prompts.

    Returns:
        (group id per row (B,), duplicated prompt tokens per group (G,)).
    """
    p = input_ids.shape[1] - response_length
    pm = attention_mask[:, :p].bool()
    key = torch.where(pm, input_ids[:, :p], torch.full_like(input_ids[:, :p], -1))
    _, gid = torch.unique(key, dim=0, return_inverse=True)
    g = int(gid.max()) + 1
    size = torch.zeros(g, dtype=torch.long).index_add_(0, gid.cpu(), torch.ones_like(gid.cpu()))
    plen = torch.zeros(g, dtype=torch.long).scatter_reduce_(0, gid.cpu(), pm.sum(1).cpu(), "amax")
    return gid.cpu(), (size - 1) * plen


@dataclass
class PolicyUpdate:
    """What :meth:`Actor.update_policy` returns."""

    metrics: dict[str, float]
    """``actor/*`` metrics (verl names)."""
    old_log_probs: torch.Tensor | None = None
    """(B, R) old log-probs the update computed itself (fused on-policy update), row-aligned
    with the input (zeros on rows with no valid token, and on rows ``trained`` leaves out);
    None when the input carried them."""
    trained: torch.Tensor | None = None
    """(B,) bool: the rows the update ran (``skip_zero_advantage``: those with a non-zero
    advantage); None when it ran every row."""


class LogProbEngine:
    """Padding-free log-probs (and entropy) of responses under one :class:`PolicyModel`.

    Used by the actor (old log-probs and the update's forward) and the reference worker.

    Args:
        policy: the loaded model (trainable or frozen).
        batch: micro-batching settings (``use_dynamic_bsz``, token budget, micro-batch rows).
        share_prefix: store each group's identical prompt once per micro-batch.
        device: compute device.
    """

    def __init__(
        self,
        policy: PolicyModel,
        batch: BatchSpec,
        *,
        share_prefix: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.policy = policy
        self.batch = batch
        self.share_prefix = share_prefix
        self.device = torch.device(device)

    def micro_batches(self, data: DataProto, rows: torch.Tensor | None = None) -> list[list[int]]:
        """Row indices per micro-batch (the same count on every FSDP2 rank); with ``rows``
        (indices into ``data``, ascending) of those rows only."""
        if rows is not None and len(rows) == len(data):
            rows = None  # every row: the micro-batches without a selection
        if rows is not None and len(rows) == 0:  # nothing to run here (other ranks may)
            return self.policy.align_micro_batches([], torch.zeros(0, dtype=torch.long))
        if rows is not None:
            sub = DataProto.from_dict(
                {k: data.batch[k][rows] for k in ("attention_mask", "responses", "input_ids")}
            )
            return [[int(rows[i]) for i in m] for m in self.micro_batches(sub)]
        am = data.batch["attention_mask"]
        r = data.batch["responses"].shape[1]
        units = extra = None
        if self.share_prefix:
            units, extra = prompt_groups(data.batch["input_ids"], am, r)
        micro = make_micro_batches(
            am.sum(1),
            use_dynamic_bsz=self.batch.use_dynamic_bsz,
            max_tokens=self.batch.ppo_max_token_len_per_gpu,
            micro_batch_size=self.batch.ppo_micro_batch_size_per_gpu,
            unit_ids=units,
            unit_extra=extra,
        )
        return self.policy.align_micro_batches(micro, am.sum(1), units)

    def forward(
        self,
        mb: dict[str, torch.Tensor],
        temperature: float,
        entropy: bool,
        sum_pi_squared: bool = False,
        topk: int = 0,
        logprobs_at: torch.Tensor | None = None,
    ):
        """(log-probs (b, R), entropy (b, R) or None[, extras when asked]) of one micro-batch,
        through the FSDP2 root's forward (extras: ``sum_pi_squared`` (b, R); ``topk`` log-probs
        and ids (b, R, K); log-probs at ``logprobs_at`` (b, R, K); see
        :func:`postrl.engine.logprob.policy_logprobs`)."""
        return self.policy.logprobs(
            mb["input_ids"],
            mb["attention_mask"],
            mb["responses"].shape[1],
            temperature=temperature,
            calculate_entropy=entropy,
            share_prefix=self.share_prefix,
            calculate_sum_pi_squared=sum_pi_squared,
            topk=topk,
            logprobs_at=logprobs_at,
        )

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, *, reference: bool = False) -> DataProto:
        """Log-probs (and ``entropys`` if ``meta_info['calculate_entropy']``, ``sum_pi_squared``
        — ``Σ_v π(v | ·)²`` per response token, same pass — if
        ``meta_info['calculate_sum_pi_squared']``, ``topk_log_probs`` / ``topk_ids`` (B, R, K) —
        the K most likely next tokens at each response position, same pass — if
        ``meta_info['calculate_topk'] = K > 0``) of the responses.

        Args:
            data: needs ``input_ids``, ``attention_mask``, ``responses``; meta ``temperature``.
            reference: with LoRA, compute with adapters disabled (the reference policy).

        Returns:
            DataProto with ``old_log_probs`` (B, R) (``ref_log_prob`` when ``reference``).
        """
        temperature = float(data.meta_info.get("temperature", 1.0))
        want_ent = bool(data.meta_info.get("calculate_entropy", False))
        want_sps = bool(data.meta_info.get("calculate_sum_pi_squared", False))
        topk = int(data.meta_info.get("calculate_topk", 0) or 0)
        micro = self.micro_batches(data)
        was_training = self.policy.module.training
        self.policy.module.eval()
        cols: dict[str, list[torch.Tensor]] = {}
        names = ["entropys"] if want_ent else []
        names += ["sum_pi_squared"] if want_sps else []
        names += ["topk_log_probs", "topk_ids"] if topk else []
        ctx = self.policy.reference() if reference else contextlib.nullcontext()
        keys = ["input_ids", "attention_mask", "responses"]
        with ctx:
            for idx in micro:
                lp, ent, *extra = self.forward(
                    rows_to_device(data, idx, keys, self.device),
                    temperature,
                    want_ent,
                    want_sps,
                    topk,
                )
                got = [lp] + ([ent] if want_ent else []) + list(extra)
                for name, x in zip(["log_probs", *names], got, strict=True):
                    cols.setdefault(name, []).append(x.cpu())
        self.policy.module.train(was_training)
        lp_name = "ref_log_prob" if reference else "old_log_probs"
        out = {lp_name: restore_order(cols["log_probs"], micro)}
        out.update({name: restore_order(cols[name], micro) for name in names})
        return DataProto.from_dict(out, meta_info={"temperature": temperature})


_UPDATE_KEYS = [
    "input_ids",
    "attention_mask",
    "responses",
    "response_mask",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    "rollout_log_probs",
    "rollout_is_weights",
    "teacher_topk_ids",
    "teacher_topk_log_probs",
]


class Actor:
    """PPO/GRPO policy engine: a :class:`LogProbEngine` plus the shared update loop.

    Args:
        policy: the loaded model.
        batch: mini/micro-batching and epochs.
        loss: the policy loss and its extras (entropy bonus, KL loss).
        optim: AdamW and schedule.
        rollout_n: responses per prompt (mini-batch = ``ppo_mini_batch_size × rollout_n``).
        share_prefix: prefix sharing in the packed forward.
        device: compute device.
        group: data-parallel process group (None: single process).
        total_steps: optimizer steps of the run (cosine schedule).
        seed: shuffling seed.
    """

    def __init__(
        self,
        policy: PolicyModel,
        *,
        batch: BatchSpec,
        loss: PolicyLossSpec,
        optim: OptimSpec,
        rollout_n: int = 1,
        share_prefix: bool = False,
        device: str | torch.device = "cpu",
        group: dist.ProcessGroup | None = None,
        total_steps: int = 0,
        seed: int = 0,
    ) -> None:
        self.policy = policy
        self.batch = batch
        self.loss = loss
        self.rollout_n = rollout_n
        self.group = group
        self.logprob = LogProbEngine(policy, batch, share_prefix=share_prefix, device=device)
        self.loop = UpdateLoop(
            policy.trainable_parameters(),
            optim,
            total_steps=total_steps,
            group=group,
            device=device,
        )
        self.loss_fn = bind_policy_loss(  # typed hyperparameters, checked once (HParamError)
            loss.policy_loss,
            loss.policy_loss_kwargs,
            common=dict(
                clip_ratio_low=loss.clip_ratio_low,
                clip_ratio_high=loss.clip_ratio_high,
                clip_ratio_c=loss.clip_ratio_c,
            ),
        )
        if loss.skip_zero_advantage and not POLICY_LOSSES.meta(loss.policy_loss).get(
            "zero_advantage_rows_free", False
        ):
            raise ValueError(
                f"actor.skip_zero_advantage=True with actor.policy_loss={loss.policy_loss!r}, "
                "whose loss does not declare that a row with zero advantages adds nothing to "
                "it (zero_advantage_rows_free): set actor.skip_zero_advantage=false"
            )
        self.distill_fn = None
        if loss.distill_loss:
            from postrl.algos.distill import DISTILL_LOSSES

            if DISTILL_LOSSES.meta(loss.distill_loss)["kind"] != "loss":
                raise ValueError(
                    f"PolicyLossSpec.distill_loss={loss.distill_loss!r} is not a loss-kind "
                    "distillation loss (its term joins the advantages, not the update's loss)"
                )
            self.distill_fn = DISTILL_LOSSES.get(loss.distill_loss)
        self.seed = seed
        self.update_count = 0
        self.entropy_coeff = float(loss.entropy_coeff)
        """The entropy bonus's weight in the next update: ``loss.entropy_coeff``, or with
        ``loss.entropy_target`` the adaptive controller's state (checkpointed)."""

    def compute_log_prob(self, data: DataProto, *, reference: bool = False) -> DataProto:
        """See :meth:`LogProbEngine.compute_log_prob`."""
        return self.logprob.compute_log_prob(data, reference=reference)

    def _mini_batches(self, data: DataProto, epoch: int) -> list[DataProto]:
        b = len(data)
        size = max(1, self.batch.ppo_mini_batch_size * self.rollout_n // self.loop.dp_size)
        order = torch.arange(b)
        if self.batch.shuffle:
            g = torch.Generator().manual_seed(
                self.seed * 1_000_003 + self.update_count * 101 + epoch
            )
            order = torch.randperm(b, generator=g)
        return split_mini_batches(data, size, order, self.group)

    def _loss_terms(self, mb, lp, ent, denoms: dict, student_topk=None) -> MicroLoss:
        c = self.loss
        denoms = dict(denoms)
        # the policy term over every row of the mini-batch (a skipped row's share is 0); the
        # entropy, KL and distillation terms are means over the rows the update trains
        rows = denoms.pop("trained", denoms)
        mask = mb["response_mask"].to(lp.dtype)
        pg, m = self.loss_fn(
            LossInputs(
                old_log_prob=mb["old_log_probs"],
                log_prob=lp,
                advantages=mb["advantages"],
                response_mask=mask,
                loss_agg_mode=c.loss_agg_mode,
                rollout_log_prob=mb.get("rollout_log_probs"),
                rollout_is_weights=mb.get("rollout_is_weights"),
                **denoms,
            )
        )
        loss = pg
        ent_loss = agg_loss(ent, mask, c.loss_agg_mode, **rows)
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * ent_loss
        terms = {"pg_loss": pg.detach(), "entropy": ent_loss.detach()}
        if c.use_kl_loss:
            if "ref_log_prob" not in mb:
                raise KeyError(
                    "actor.use_kl_loss=True needs batch['ref_log_prob']; "
                    "enable the reference policy"
                )
            kl = agg_loss(
                kl_penalty(lp, mb["ref_log_prob"], c.kl_loss_type),
                mask,
                c.loss_agg_mode,
                **rows,
            )
            loss = loss + c.kl_loss_coef * kl
            terms["kl_loss"] = kl.detach()
        if self.distill_fn is not None:  # e.g. gkd: JSD(β) over the teacher's top-k
            d = self.distill_fn(
                student_topk, mb["teacher_topk_log_probs"], mask, beta=c.distill_beta
            )
            dl = agg_loss(d, mask, c.loss_agg_mode, **rows)
            loss = loss + c.distill_coef * dl
            terms["distill_loss"] = dl.detach()
        return MicroLoss(loss, sums=terms, means=m)

    def update_policy(self, data: DataProto) -> PolicyUpdate:
        """One PPO update over ``data`` (this rank's shard).

        Needs ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``,
        ``old_log_probs``, ``advantages`` (+ ``ref_log_prob`` with the KL loss, optional
        ``rollout_log_probs`` / ``rollout_is_weights``); meta ``temperature``.

        Without ``old_log_probs`` the update must be on-policy (one mini-batch, ``ppo_epochs=1``):
        the old log-probs are then the detached log-probs of the update's own forward — the
        parameters have not moved yet, so this is exactly π_old — and come back in
        :attr:`PolicyUpdate.old_log_probs`. This saves the separate old-log-prob pass (verl makes
        the same substitution inside its update but still runs the pass).
        """
        temperature = float(data.meta_info.get("temperature", 1.0))
        keys = list(_UPDATE_KEYS)
        fused = "old_log_probs" not in data.batch
        old: torch.Tensor | None = None
        epochs = self.batch.ppo_epochs
        if fused:  # on-policy: old log-probs come from this update's own forward
            if epochs != 1:
                raise ValueError(
                    "update_policy without batch['old_log_probs'] needs actor.ppo_epochs=1 "
                    f"(on-policy), got {epochs}: compute old log-probs first"
                )
            data = data.union(DataProto.from_dict({"_row": torch.arange(len(data))}))
            keys.append("_row")
            old = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)

        def mini_batches(d: DataProto, epoch: int) -> list[DataProto]:
            minis = self._mini_batches(d, epoch)
            if fused and len(minis) != 1:
                raise ValueError(
                    "update_policy without batch['old_log_probs'] needs one mini-batch per update "
                    f"(on-policy), got {len(minis)}: set actor.ppo_mini_batch_size="
                    "data.train_batch_size or compute old log-probs first"
                )
            return minis

        skip = self.loss.skip_zero_advantage
        trained = torch.zeros(len(data), dtype=torch.bool) if skip else None
        if skip and "_row" not in data.batch:
            data = data.union(DataProto.from_dict({"_row": torch.arange(len(data))}))
            keys.append("_row")

        def trained_rows(mini: DataProto) -> torch.Tensor:
            adv = mini.batch["advantages"] * mini.batch["response_mask"]
            rows = torch.nonzero((adv != 0).any(-1)).flatten()  # (b',) rows with a gradient
            assert trained is not None
            trained[mini.batch["_row"][rows]] = True
            return rows

        def micro_loss(mb: dict[str, torch.Tensor], denoms: dict) -> MicroLoss:
            at = None
            if self.distill_fn is not None:
                if "teacher_topk_ids" not in mb:
                    raise KeyError(
                        f"actor distill_loss={self.loss.distill_loss!r} needs batch"
                        "['teacher_topk_ids'] and ['teacher_topk_log_probs'] (the teacher's "
                        "top-k): configure distill.teacher_path or distill.teacher_url"
                    )
                lp, ent, at = self.logprob.forward(
                    mb, temperature, True, logprobs_at=mb["teacher_topk_ids"]
                )
            else:
                lp, ent = self.logprob.forward(mb, temperature, True)
            if fused:  # π_old = π_θ at this point: ratio exactly 1, gradient of the on-policy loss
                mb["old_log_probs"] = lp.detach()
                old[mb["_row"].cpu()] = mb["old_log_probs"].float().cpu()
            return self._loss_terms(mb, lp, ent, denoms, at)

        self.policy.module.train()
        metrics = self.loop.run(
            data,
            epochs=epochs,
            mini_batches=mini_batches,
            micro_batches=self.logprob.micro_batches,
            keys=keys,
            micro_loss=micro_loss,
            prefix="actor",
            trained_rows=trained_rows if skip else None,
        )
        if trained is not None:  # each row counted once, whatever the epochs and dp ranks
            if old is not None:  # (a rank with nothing to train ran one row masked)
                old[~trained] = 0.0
            valid = data.batch["response_mask"].sum(-1) > 0  # (padding rows are not rows)
            n = allreduce_sum(
                torch.stack([(valid & ~trained).sum(), valid.sum()]).float(), self.group
            )
            metrics["actor/zero_adv_skipped_frac"] = float(n[0] / n[1].clamp(min=1))
        self.update_count += 1
        c = self.loss
        if c.entropy_target > 0:  # metrics are all-reduced: every rank moves the same way
            metrics["actor/entropy_coeff"] = self.entropy_coeff  # the weight this update used
            if "actor/entropy" in metrics:  # absent when no mini-batch held a valid token
                self.entropy_coeff = adapt_entropy_coeff(
                    self.entropy_coeff,
                    metrics["actor/entropy"],
                    target=c.entropy_target,
                    step=c.entropy_coeff_step,
                    max_coeff=c.entropy_coeff_max,
                    min_coeff=c.entropy_coeff_min,
                )
        return PolicyUpdate(metrics, old, trained)
