"""Pieces shared by the role workers: config → engine settings, device/seed setup, FSDP2
sharding, the rank-0-output dispatch mode.

The engine never sees the run's config: each worker translates the sections it needs into the
engine's own dataclasses here (:mod:`postrl.engine.specs`: ``ModelSpec``, ``OptimSpec``,
``BatchSpec``, ``PolicyLossSpec``), field by field with the same names; the config takes those
fields' defaults from the specs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from postrl.controller import Dispatch, register
from postrl.controller.dispatch import DispatchMode
from postrl.engine.specs import BatchSpec, ModelSpec, OptimSpec, PolicyLossSpec
from postrl.protocol import DataProto

__all__ = [
    "ALL_RANKS_RANK0_OUT",
    "LendsCores",
    "barrier",
    "batch_spec",
    "metrics_proto",
    "model_spec",
    "optim_spec",
    "policy_loss_spec",
    "setup",
    "shard_if",
    "share_prefix",
]

S = TypeVar("S")


def _spec(cls: type[S], section: Any, **override: Any) -> S:
    """``cls`` filled with the same-named attributes of a config section (plus ``override``)."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{n: getattr(section, n) for n in names if n not in override}, **override)


def model_spec(model_cfg: Any, **override: Any) -> ModelSpec:
    """:class:`ModelSpec` from ``cfg.model`` (``override``: e.g. another ``path``)."""
    return _spec(ModelSpec, model_cfg, **override)


def optim_spec(optim_cfg: Any) -> OptimSpec:
    """:class:`OptimSpec` from an ``*.optim`` section."""
    return _spec(OptimSpec, optim_cfg, betas=tuple(optim_cfg.betas))


def batch_spec(role_cfg: Any) -> BatchSpec:
    """:class:`BatchSpec` from ``cfg.actor`` or ``cfg.critic`` (critics never shuffle)."""
    return _spec(BatchSpec, role_cfg, shuffle=bool(getattr(role_cfg, "shuffle", False)))


def policy_loss_spec(actor_cfg: Any, distill_cfg: Any = None) -> PolicyLossSpec:
    """:class:`PolicyLossSpec` from ``cfg.actor`` (and ``cfg.distill``: a configured teacher
    whose ``distill.loss`` is registered ``kind="loss"``, e.g. ``gkd``, joins the update's
    loss; an ``advantage``-kind loss does not touch the update)."""
    distill: dict[str, Any] = {
        "distill_loss": "",
        "distill_coef": PolicyLossSpec.distill_coef,
        "distill_beta": PolicyLossSpec.distill_beta,
    }
    if distill_cfg is not None and distill_cfg.enabled:
        from postrl.algos.distill import DISTILL_LOSSES

        if DISTILL_LOSSES.meta(distill_cfg.loss)["kind"] == "loss":
            distill = {
                "distill_loss": distill_cfg.loss,
                "distill_coef": float(distill_cfg.coef),
                "distill_beta": float(distill_cfg.beta),
            }
    return _spec(
        PolicyLossSpec, actor_cfg, policy_loss_kwargs=dict(actor_cfg.policy_loss_kwargs), **distill
    )


def share_prefix(cfg: Any) -> bool:
    """``actor.share_prompt_prefix`` resolved: None (auto) = on when ``rollout.n > 1``."""
    s = cfg.actor.share_prompt_prefix
    return bool(cfg.rollout.n > 1) if s is None else bool(s)


ALL_RANKS_RANK0_OUT = DispatchMode(
    "all_ranks_rank0_out",
    dispatch_fn=lambda ctx, args, kwargs: [(args, kwargs)] * ctx.world_size,
    collect_fn=lambda ctx, outputs: outputs[0],
)
"""Same call on every rank (a collective inside, e.g. gathering FSDP2 shards); rank 0's output."""


def shard_if(strategy: str, model, group, dev) -> None:
    """FSDP2-shard ``model`` (a ``PolicyModel`` or ``CriticModel``) when dp > 1 and
    ``strategy`` is ``fsdp2``."""
    if group is not None and strategy == "fsdp2":
        model.shard(group, dev)


def setup(cfg) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Denormal flushing, thread count and seed from ``cfg.trainer``; the device and the dp
    group (None on dp=1)."""
    torch.set_flush_denormal(cfg.trainer.flush_denormal)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    return torch.device(cfg.trainer.device), group


def metrics_proto(m: dict[str, float]) -> DataProto:
    """An empty DataProto carrying ``m`` in ``meta_info['metrics']``."""
    return DataProto(meta_info={"metrics": m})


def barrier(group) -> None:
    """``dist.barrier`` on ``group`` when dp > 1."""
    if group is not None:
        dist.barrier(group)


class LendsCores:
    """Mixin of a training worker whose compute may borrow the cores of idle rollout replica
    processes on its machine (``trainer.lend_cores``; :mod:`postrl.engine.lending`). The worker
    sets ``self.cfg`` and calls :meth:`_compute` around each compute call; the model it hooks is
    :meth:`_lending_model`."""

    _lender: Any = None

    def _lending_model(self) -> torch.nn.Module:
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def lend_cores(self, directory: str, owners: dict[str, int]) -> int:
        """Borrow the cores of ``owners`` (``{name: threads}`` leases in ``directory``, see
        :mod:`postrl.protocol.cores`) while they are idle; returns the hooked layer count."""
        from postrl.engine.lending import ThreadLender
        from postrl.protocol.cores import CoreBorrower

        if self._lender is not None:
            self._lender.close()
        self._lender = ThreadLender(CoreBorrower(directory, owners), self.cfg.trainer.num_threads)
        return self._lender.install(self._lending_model())

    @contextlib.contextmanager
    def _compute(self, metrics: dict[str, float] | None = None, key: str = "") -> Iterator[None]:
        """One compute call on borrowed cores where lent; ``metrics[key]``: its seconds on
        borrowed cores."""
        lender = self._lender
        if lender is None:
            yield
            return
        before = lender.borrower.borrowed_s
        with lender.section():
            yield
        if metrics is not None:
            metrics[key] = lender.borrower.borrowed_s - before
