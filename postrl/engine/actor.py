"""The policy (actor) engine: padding-free log-probs and the PPO/GRPO update.

Update (verl's ``update_policy``, with explicit global denominators):

    for epoch in range(ppo_epochs):
        for mini-batch (ppo_mini_batch_size × rollout.n responses, split over dp ranks):
            N_tok, N_seq = Σ_ranks valid tokens / non-empty rows of the mini-batch   (all-reduce)
            for micro-batch (token budget, Karmarkar–Karp balanced):
                L = pg_loss − c_H · agg(H) + c_KL · agg(KL(π‖π_ref))   (agg with N_tok, N_seq)
                L.backward()                       # additive share of the mini-batch loss
            all-reduce(SUM) grads; clip; step unless the norm is non-finite (counted)

Rows whose ``response_mask`` is all zero (failed samples, filtered groups) are dropped inside each
mini-batch (:func:`postrl.engine.minibatch.split_mini_batches`): they contribute nothing to the
loss or the denominators, and every dp rank still runs the same mini-batches and collectives. A
mini-batch with no valid token on any rank is skipped (no optimizer step).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict

import torch
import torch.distributed as dist

from postrl.algos.aggregation import agg_loss
from postrl.algos.kl import kl_penalty
from postrl.algos.policy_losses import get_policy_loss
from postrl.engine.microbatch import make_micro_batches, restore_order
from postrl.engine.minibatch import split_mini_batches
from postrl.engine.model import PolicyModel
from postrl.engine.optim import (
    allreduce_grads,
    allreduce_sum,
    build_optimizer,
    build_scheduler,
    guarded_step,
)
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["Actor", "prompt_groups"]


def prompt_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group rows with identical prompts: (group id per row (B,), duplicated prompt tokens per group (G,))."""
    p = input_ids.shape[1] - response_length
    pm = attention_mask[:, :p].bool()
    key = torch.where(pm, input_ids[:, :p], torch.full_like(input_ids[:, :p], -1))
    _, gid = torch.unique(key, dim=0, return_inverse=True)
    g = int(gid.max()) + 1
    size = torch.zeros(g, dtype=torch.long).index_add_(0, gid.cpu(), torch.ones_like(gid.cpu()))
    plen = torch.zeros(g, dtype=torch.long).scatter_reduce_(0, gid.cpu(), pm.sum(1).cpu(), "amax")
    return gid.cpu(), (size - 1) * plen


class Actor:
    """PPO/GRPO policy engine over one :class:`PolicyModel`.

    Args:
        policy: the loaded model.
        cfg: ``ActorConfig``.
        rollout_n: responses per prompt (mini-batch = ``ppo_mini_batch_size × rollout_n``).
        device: compute device.
        group: data-parallel process group (None: single process).
        total_steps: optimizer steps of the run (cosine schedule).
        seed: shuffling seed.
    """

    def __init__(
        self,
        policy: PolicyModel,
        cfg,
        *,
        rollout_n: int = 1,
        device: str | torch.device = "cpu",
        group: dist.ProcessGroup | None = None,
        total_steps: int = 0,
        seed: int = 0,
    ) -> None:
        self.policy = policy
        self.cfg = cfg
        self.rollout_n = rollout_n
        self.device = torch.device(device)
        self.group = group
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.params = list(policy.trainable_parameters())
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, total_steps)
        self.loss_fn = get_policy_loss(cfg.policy_loss)
        self.seed = seed
        self.update_count = 0
        self.nonfinite_skips = 0
        self.fused_old_log_probs: torch.Tensor | None = None
        """(B, R) old log-probs of the last update when it computed them itself (no ``old_log_probs`` given)."""

    # ------------------------------------------------------------------ helpers
    def share_prefix(self) -> bool:
        """``actor.share_prompt_prefix`` resolved (None = on when rollout.n > 1)."""
        s = self.cfg.share_prompt_prefix
        return bool(self.rollout_n > 1) if s is None else bool(s)

    def _micro(self, data: DataProto, max_tokens: int) -> list[list[int]]:
        am = data.batch["attention_mask"]
        r = data.batch["responses"].shape[1]
        units = extra = None
        if self.share_prefix():
            units, extra = prompt_groups(data.batch["input_ids"], am, r)
        micro = make_micro_batches(
            am.sum(1),
            use_dynamic_bsz=self.cfg.use_dynamic_bsz,
            max_tokens=max_tokens,
            micro_batch_size=self.cfg.ppo_micro_batch_size_per_gpu,
            unit_ids=units,
            unit_extra=extra,
        )
        return self.policy.align_micro_batches(
            micro, am.sum(1), units
        )  # FSDP2: same count on every rank

    def _forward(self, mb: dict[str, torch.Tensor], temperature: float, entropy: bool):
        r = mb["responses"].shape[1]
        return self.policy.logprobs(
            mb["input_ids"],
            mb["attention_mask"],
            r,  # the FSDP2 root's forward
            temperature=temperature,
            calculate_entropy=entropy,
            share_prefix=self.share_prefix(),
        )

    def _to_dev(self, data: DataProto, idx: list[int], keys: list[str]) -> dict[str, torch.Tensor]:
        ix = torch.tensor(idx, dtype=torch.long)
        return {k: data.batch[k][ix].to(self.device) for k in keys if k in data.batch}

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, *, reference: bool = False) -> DataProto:
        """Log-probs (and ``entropys`` if ``meta_info['calculate_entropy']``) of the responses.

        Args:
            data: needs ``input_ids``, ``attention_mask``, ``responses``; meta ``temperature``.
            reference: with LoRA, compute with adapters disabled (the reference policy).

        Returns:
            DataProto with ``old_log_probs`` (B, R) (``ref_log_prob`` when ``reference``).
        """
        temperature = float(data.meta_info.get("temperature", 1.0))
        want_ent = bool(data.meta_info.get("calculate_entropy", False))
        micro = self._micro(data, self.cfg.ppo_max_token_len_per_gpu)
        was_training = self.policy.module.training
        self.policy.module.eval()
        lps, ents = [], []
        ctx = self.policy.reference() if reference else contextlib.nullcontext()
        with ctx:
            for idx in micro:
                mb = self._to_dev(data, idx, ["input_ids", "attention_mask", "responses"])
                lp, ent = self._forward(mb, temperature, want_ent)
                lps.append(lp.cpu())
                if want_ent:
                    ents.append(ent.cpu())
        self.policy.module.train(was_training)
        out = {("ref_log_prob" if reference else "old_log_probs"): restore_order(lps, micro)}
        if want_ent:
            out["entropys"] = restore_order(ents, micro)
        return DataProto.from_dict(out, meta_info={"temperature": temperature})

    # ------------------------------------------------------------------ update
    def _mini_batches(self, data: DataProto, epoch: int) -> list[DataProto]:
        b = len(data)
        size = max(1, self.cfg.ppo_mini_batch_size * self.rollout_n // self.dp_size)
        order = torch.arange(b)
        if self.cfg.shuffle:
            g = torch.Generator().manual_seed(
                self.seed * 1_000_003 + self.update_count * 101 + epoch
            )
            order = torch.randperm(b, generator=g)
        return split_mini_batches(data, size, order, self.group)

    def _loss_terms(self, mb, lp, ent, denoms: dict):
        hp = dict(
            clip_ratio_low=self.cfg.clip_ratio_low,
            clip_ratio_high=self.cfg.clip_ratio_high,
            clip_ratio_c=self.cfg.clip_ratio_c,
            **self.cfg.policy_loss_kwargs,
        )
        mask = mb["response_mask"].to(lp.dtype)
        pg, m = self.loss_fn(
            mb["old_log_probs"],
            lp,
            mb["advantages"],
            mask,
            loss_agg_mode=self.cfg.loss_agg_mode,
            rollout_log_prob=mb.get("rollout_log_probs"),
            rollout_is_weights=mb.get("rollout_is_weights"),
            **denoms,
            **hp,
        )
        loss = pg
        ent_loss = agg_loss(ent, mask, self.cfg.loss_agg_mode, **denoms)
        if self.cfg.entropy_coeff:
            loss = loss - self.cfg.entropy_coeff * ent_loss
        terms = {"pg_loss": pg.detach(), "entropy": ent_loss.detach()}
        if self.cfg.use_kl_loss:
            if "ref_log_prob" not in mb:
                raise KeyError(
                    "actor.use_kl_loss=True needs batch['ref_log_prob']; enable the reference policy"
                )
            kl = agg_loss(
                kl_penalty(lp, mb["ref_log_prob"], self.cfg.kl_loss_type),
                mask,
                self.cfg.loss_agg_mode,
                **denoms,
            )
            loss = loss + self.cfg.kl_loss_coef * kl
            terms["kl_loss"] = kl.detach()
        return loss, terms, m

    def update_policy(self, data: DataProto) -> dict[str, float]:
        """One PPO update over ``data`` (this rank's shard); returns verl-named metrics.

        Needs ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``,
        ``old_log_probs``, ``advantages`` (+ ``ref_log_prob`` with the KL loss, optional
        ``rollout_log_probs`` / ``rollout_is_weights``); meta ``temperature``.

        Without ``old_log_probs`` the update must be on-policy (one mini-batch, ``ppo_epochs=1``):
        the old log-probs are then the detached log-probs of the update's own forward — the
        parameters have not moved yet, so this is exactly π_old — and are kept in
        :attr:`fused_old_log_probs` (zeros on rows with no valid token). This saves the separate
        old-log-prob pass (verl makes the same substitution inside its update but still runs the
        pass).
        """
        temperature = float(data.meta_info.get("temperature", 1.0))
        keys = [
            "input_ids",
            "attention_mask",
            "responses",
            "response_mask",
            "old_log_probs",
            "advantages",
            "ref_log_prob",
            "rollout_log_probs",
            "rollout_is_weights",
        ]
        fused = "old_log_probs" not in data.batch
        self.fused_old_log_probs = None
        if (
            fused
        ):  # on-policy: old log-probs come from this update's own forward (see fuse_old_log_prob)
            if self.cfg.ppo_epochs != 1:
                raise ValueError(
                    f"update_policy without batch['old_log_probs'] needs actor.ppo_epochs=1 (on-policy), "
                    f"got {self.cfg.ppo_epochs}: compute old log-probs first"
                )
            data = data.union(DataProto.from_dict({"_row": torch.arange(len(data))}))
            keys.append("_row")
            self.fused_old_log_probs = torch.zeros(
                data.batch["responses"].shape, dtype=torch.float32
            )
        sums: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.policy.module.train()
        for epoch in range(self.cfg.ppo_epochs):
            minis = self._mini_batches(data, epoch)
            if fused and len(minis) != 1:
                raise ValueError(
                    f"update_policy without batch['old_log_probs'] needs one mini-batch per update (on-policy), "
                    f"got {len(minis)}: set actor.ppo_mini_batch_size=data.train_batch_size or compute old log-probs first"
                )
            for mini in minis:
                rm = mini.batch["response_mask"].float()
                counts = allreduce_sum(
                    torch.stack([rm.sum(), (rm.sum(-1) > 0).float().sum()]), self.group
                )
                if not bool(counts[0] > 0):  # no valid token on any rank: nothing to learn, no step
                    continue
                denoms = dict(
                    global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=self.dp_size
                )
                step: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
                for idx in self._micro(mini, self.cfg.ppo_max_token_len_per_gpu):
                    mb = self._to_dev(mini, idx, keys)
                    lp, ent = self._forward(mb, temperature, True)
                    if (
                        fused
                    ):  # π_old = π_θ at this point: ratio exactly 1, gradient of the on-policy loss
                        mb["old_log_probs"] = lp.detach()
                        self.fused_old_log_probs[mb["_row"].cpu()] = (
                            mb["old_log_probs"].float().cpu()
                        )
                    loss, terms, m = self._loss_terms(mb, lp, ent, denoms)
                    loss.backward()
                    w = mb["response_mask"].sum().float().cpu() / counts[0].clamp(
                        min=1
                    )  # token share of the mini-batch
                    for k, v in terms.items():
                        step[k] = step[k] + v.cpu()
                    for k, v in m.items():
                        step[k] = step[k] + v.cpu() * w
                allreduce_grads(self.params, self.group)
                lr = self.optimizer.param_groups[0]["lr"]
                norm, ok = guarded_step(
                    self.params, self.optimizer, self.scheduler, self.cfg.optim.grad_clip
                )
                self.nonfinite_skips += int(not ok)
                for k in sorted(step):  # every value is an additive share: sum over ranks
                    sums[k].append(allreduce_sum(step[k], self.group))
                sums["grad_norm"].append(norm.cpu())
                sums["lr"].append(torch.tensor(lr))
        self.update_count += 1
        out = {f"actor/{k}": float(torch.stack(v).mean()) for k, v in sums.items()}
        out["actor/grad_norm_nonfinite_skips"] = float(self.nonfinite_skips)
        return out
