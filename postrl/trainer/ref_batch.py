"""Rows by reference on the driver: :class:`RefBatch`, the batch of the object-store data plane
(``trainer.async.data_plane=object_store``), and the driver-side pieces that read its tags.

A taken mini-batch of trajectories that stay in Ray's object store is a :class:`RefBatch`:
one reference per row plus the tags the driver needs. ``RLTrainer.step`` runs the same stages on
it as on a padded ``DataProto`` (one step, two transports): balance from the tagged lengths
(``batch["seq_len"]``), worker-group calls with one :class:`~postrl.protocol.refs.RefShard` per
rank (:meth:`RefBatch.ref_shards`; the answers stay on the workers and join the batch by
reference, :meth:`RefBatch.union`), the outcome estimator on the rows' scores
(:func:`outcome_advantages`), stage 9 from the tags (:func:`tag_step_metrics`). A run with a
stage that reads tensors on the driver (:func:`driver_tensor_reasons`) gets the taken groups
fetched instead (:func:`fetch_batch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from postrl.protocol.traffic import DRIVER_TRAFFIC

if TYPE_CHECKING:  # pragma: no cover
    from postrl.trainer.object_store import RemoteTrajectory

__all__ = [
    "PAYLOAD_KEYS",
    "DriverTensorError",
    "RefBatch",
    "driver_tensor_reasons",
    "fetch_batch",
    "outcome_advantages",
    "tag_step_metrics",
]


PAYLOAD_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "rollout_policy_version",
    "token_level_scores",
    "sample_valid",
)
"""The columns a scored payload holds (the rollout layout plus the reward stage's)."""


class DriverTensorError(RuntimeError):
    """A stage read a tensor of a :class:`RefBatch` on the driver."""


class _Columns(Mapping):
    """``RefBatch.batch``: which columns the rows have (``in``), and the tags' per-row values
    as ``(B,)`` tensors (``seq_len``); a tensor column lives in the object store, and reading
    it here raises :class:`DriverTensorError` — a stage that needs it on the driver declares it
    (:func:`driver_tensor_reasons`), and then the batch is fetched instead."""

    def __init__(self, batch: RefBatch) -> None:
        self._b = batch

    def _tags(self) -> dict[str, torch.Tensor]:
        s = self._b.scalars
        lens = torch.as_tensor(s["prompt_len"] + s["response_len"]).long()
        return {"seq_len": lens}

    def __getitem__(self, key: str) -> torch.Tensor:
        tags = self._tags()
        if key in tags:
            return tags[key]
        if key in self:
            raise DriverTensorError(
                f"batch[{key!r}] of a RefBatch lives in the object store "
                f"(trainer.async.data_plane=object_store): a stage that reads it on the driver "
                f"must be listed by trainer/object_store.py::driver_tensor_reasons, so the "
                f"taken groups are fetched for it"
            )
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        keys = [*PAYLOAD_KEYS, *self._b.column_keys, *self._b.row_values, "seq_len"]
        return iter(dict.fromkeys(keys))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return key in set(iter(self))


@dataclass
class RefBatch:
    """A training batch in the object store: one reference per row plus what the driver needs
    (uids and dataset indices for the ledger and the sampler, per-row scalars for advantages
    and metrics). ``len()`` is the number of rows.

    It goes through the step's stages like a ``DataProto``: ``batch`` says which columns the
    rows have (:class:`_Columns`), :meth:`reorder` balances it, a dp-split call gets one
    :class:`~postrl.protocol.refs.RefShard` per rank (:meth:`ref_shards`) and answers with
    :class:`~postrl.protocol.refs.RemoteProto` columns that :meth:`union` keeps by reference,
    per-row values from the driver (an outcome advantage) join as ``row_values``."""

    refs: list[Any]
    rows: list[int]
    """Each row's index within its payload (a payload holds one rollout-side call's rows)."""
    non_tensor_batch: dict[str, np.ndarray]
    scalars: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)
    masked: np.ndarray | None = None
    """Rows that train nothing (a filtered group standing in for an empty batch)."""
    columns: list[list[Any]] = field(default_factory=list)
    """Answers of earlier dp calls on this batch, one ``RemoteProto`` per rank each."""
    column_keys: tuple[str, ...] = ()
    row_values: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-row values from the driver, broadcast over each row's response mask on the worker."""
    timeout_s: float | None = None
    """Deadline of the workers' fetches (``trainer.async.timeout_s``)."""

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def batch(self) -> _Columns:
        """The columns the rows have (module docstring of :class:`_Columns`)."""
        return _Columns(self)

    def reorder(self, perm: Any) -> RefBatch:
        """The rows in the order ``perm`` (before any dp call: columns are per shard)."""
        if self.columns:
            raise ValueError("RefBatch.reorder after a dp call: its columns are per shard")
        idx = [int(i) for i in perm]
        return dataclasses.replace(
            self,
            refs=[self.refs[i] for i in idx],
            rows=[self.rows[i] for i in idx],
            non_tensor_batch={k: v[idx] for k, v in self.non_tensor_batch.items()},
            scalars={k: v[idx] for k, v in self.scalars.items()},
            masked=None if self.masked is None else self.masked[idx],
            row_values={k: v[idx] for k, v in self.row_values.items()},
        )

    def union(self, other: Any) -> RefBatch:
        """This batch with a dp call's answers joined (one ``RemoteProto`` per rank, made on
        :meth:`ref_shards` of this batch: they stay in the object store)."""
        if not isinstance(other, list) or not all(hasattr(o, "keys") for o in other):
            raise TypeError(f"RefBatch.union takes a dp call's RemoteProto answers, not {other!r}")
        keys = tuple(k for o in other[:1] for k in o.keys)
        return dataclasses.replace(
            self,
            columns=[*self.columns, list(other)],
            column_keys=tuple(dict.fromkeys([*self.column_keys, *keys])),
        )

    def with_row_values(self, **values: Any) -> RefBatch:
        """This batch with per-row values (``(B,)`` each) joined."""
        rv = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        return dataclasses.replace(self, row_values={**self.row_values, **rv})

    def ref_shards(self, n: int) -> list[Any]:
        """One :class:`~postrl.protocol.refs.RefShard` per dp rank: the rows in order, the
        last shard padded with masked copies of the first rows (the same layout every call,
        so a rank's columns line up with its rows)."""
        from postrl.engine.minibatch import ZEROED_KEYS
        from postrl.protocol.refs import RefShard

        rows = len(self)
        if rows == 0:
            raise ValueError("RefBatch.ref_shards of an empty batch")
        pad = (-rows) % n
        picks = list(range(rows)) + [i % rows for i in range(pad)]
        masked = [bool(self.masked[i]) if self.masked is not None else False for i in range(rows)]
        masked += [True] * pad
        size = len(picks) // n
        shards = []
        for r in range(n):
            sl = range(r * size, (r + 1) * size)
            shards.append(
                RefShard(
                    refs=[self.refs[picks[j]] for j in sl],
                    rows=[self.rows[picks[j]] for j in sl],
                    masked=[masked[j] for j in sl],
                    columns=[col[r] for col in self.columns if col[r].ref is not None],
                    row_values={
                        k: [float(v[picks[j]]) for j in sl] for k, v in self.row_values.items()
                    },
                    meta_info=dict(self.meta_info),
                    zeroed_keys=tuple(ZEROED_KEYS),
                    timeout_s=self.timeout_s,
                )
            )
        return shards

    @classmethod
    def from_groups(cls, groups: list[tuple[str, int, list[Any]]]) -> RefBatch:
        """From ``(uid, dataset index, trajectories)`` per group; a trajectory is a
        :class:`RemoteTrajectory`, or a one-row scored ``DataProto`` (a group restored from a
        checkpoint and scored on the driver), which is put into the object store here."""
        from postrl.trainer.object_store import RemoteTrajectory

        refs: list[Any] = []
        offsets: list[int] = []
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "uid",
                "index",
                "sample_index",
                "num_turns",
                "finish_reason",
                "agent_metrics",
                "min_version",
                "max_version",
                "spans",
            )
        }
        sc: dict[str, list[float]] = {
            k: [] for k in ("score", "valid", "prompt_len", "response_len", "policy_tokens")
        }
        for uid, index, trajs in groups:
            for k, t in enumerate(trajs):
                if not isinstance(t, RemoteTrajectory):
                    t = _local_row(t)
                refs.append(t.ref)
                offsets.append(t.row)
                known = [v for n, v in t.response_versions if n > 0 and v >= 0]
                for key, v in (
                    ("uid", uid),
                    ("index", index),
                    ("sample_index", k),
                    ("num_turns", t.num_turns),
                    ("finish_reason", t.finish_reason),
                    ("agent_metrics", t.agent_metrics),
                    ("min_version", min(known, default=-1)),
                    ("max_version", max(known, default=-1)),
                    ("spans", len(set(known))),
                ):
                    cols[key].append(v)
                for key, v in (
                    ("score", t.score),
                    ("valid", float(t.valid)),
                    ("prompt_len", t.prompt_len),
                    ("response_len", t.response_len),
                    ("policy_tokens", t.policy_tokens),
                ):
                    sc[key].append(float(v))
        nt = {k: np.array(v, dtype=object) for k, v in cols.items()}
        for k in ("index", "num_turns", "min_version", "max_version", "spans", "sample_index"):
            nt[k] = np.asarray(cols[k], dtype=np.int64)
        scalars = {k: np.asarray(v, dtype=np.float64) for k, v in sc.items()}
        return cls(refs, offsets, nt, scalars)


def _local_row(row: Any) -> RemoteTrajectory:
    """A one-row scored ``DataProto`` put into the object store from the driver."""
    import ray

    from postrl.trainer.object_store import RemoteTrajectory

    b, nt = row.batch, row.non_tensor_batch
    versions = b["rollout_policy_version"][0]
    known = versions[versions >= 0].tolist()
    return RemoteTrajectory(
        ref=ray.put({"batch": row}),
        prompt_len=int(b["attention_mask"][0, : b["prompts"].shape[1]].sum()),
        response_len=int(b["attention_mask"][0, b["prompts"].shape[1] :].sum()),
        policy_tokens=int(b["response_mask"][0].sum()),
        response_versions=[(1, int(v)) for v in known],
        score=float(b["token_level_scores"][0].sum()),
        valid=bool(b["sample_valid"][0]),
        num_turns=int(nt["num_turns"][0]),
        finish_reason=str(nt["finish_reason"][0]),
        agent_metrics=dict(nt["agent_metrics"][0] or {}),
        reward_metrics={},
    )


def driver_tensor_reasons(cfg: Any) -> list[str]:
    """Why this run's step reads batch tensors on the driver (empty: it trains from tags and
    references alone): the ``fetched`` rows of the data plane's table that apply
    (``postrl/trainer/planes.py``: a token-level estimator such as GAE with its critic, KL in
    the reward, downsampling, rollout rejection sampling, a distillation teacher). With any of
    them the taken groups are fetched to the driver (:func:`fetch_batch`) and the step runs as
    on the ``driver`` plane."""
    from postrl.trainer.planes import FETCHED, plane_rules

    rules = plane_rules(cfg.trainer.async_.data_plane)
    return [on for r in rules if r.how == FETCHED and (on := r.applies(cfg))]


def fetch_batch(groups: list[tuple[str, int, list[Any]]], timeout_s: float) -> Any:
    """The taken groups as one scored batch on the driver, in group order: each payload
    fetched from the object store once (counted as ``driver/*`` traffic on channel
    ``object_store.fetch``), the wanted rows of each padded into the rollout layout with
    :func:`~postrl.protocol.layout.concat_rollouts`. ``groups`` as for
    :meth:`RefBatch.from_groups` (a one-row ``DataProto`` is a restored row, already here)."""
    import ray

    from postrl.protocol.layout import concat_rollouts
    from postrl.trainer.object_store import RemoteTrajectory

    remote = [t.ref for _, _, trajs in groups for t in trajs if isinstance(t, RemoteTrajectory)]
    unique = list(dict.fromkeys(remote))
    fetched = ray.get(unique, timeout=timeout_s) if unique else []
    DRIVER_TRAFFIC.count("in", "object_store.fetch", [p["batch"] for p in fetched])
    payloads = {ref: p["batch"] for ref, p in zip(unique, fetched, strict=True)}
    rows = [
        payloads[t.ref][t.row : t.row + 1] if isinstance(t, RemoteTrajectory) else t
        for _, _, trajs in groups
        for t in trajs
    ]
    return concat_rollouts(rows)


def outcome_advantages(batch: RefBatch, algo: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """One advantage per row from the rows' scores: the configured (outcome) estimator on
    ``token_level_rewards`` of one token per policy token (the score on the first), with the
    rows' policy-token counts as the mask — the same numbers it gives on the full batch, where
    an outcome estimator's advantage is constant over a row's tokens. Returns ``(B,)`` float32
    advantages and ``critic/advantages/*`` metrics over tokens."""
    from postrl.trainer.stages import _bound_estimator

    s = batch.scalars
    lens = torch.as_tensor(s["policy_tokens"], dtype=torch.long)
    T = max(1, int(lens.max()) if len(lens) else 1)
    mask = (torch.arange(T)[None, :] < lens[:, None]).long()  # (B, T)
    rewards = torch.zeros(len(batch), T, dtype=torch.float32)
    rewards[:, 0] = torch.as_tensor(s["score"], dtype=torch.float32)
    fn = _bound_estimator(algo.adv_estimator, algo.adv_estimator_kwargs)
    adv, _ = fn(
        token_level_rewards=rewards,
        response_mask=mask,
        index=np.asarray(batch.non_tensor_batch["uid"]),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        sample_mask=torch.as_tensor(s["valid"] > 0),
    )
    per_row = adv[:, 0].clone()
    spread = (adv - per_row[:, None]).abs().masked_fill(mask == 0, 0.0)
    if len(batch) and float(spread.max()) > 1e-5:
        raise ValueError(
            f"algorithm.adv_estimator={algo.adv_estimator} gave advantages that vary within a "
            f"row; trainer.async.data_plane=object_store needs an outcome estimator (one value "
            f"per trajectory); set trainer.async.data_plane=driver"
        )
    per_row = torch.where(lens > 0, per_row, torch.zeros_like(per_row))
    from postrl.trainer.metrics import _stats

    m: dict[str, Any] = {}
    tok = adv[mask.bool()]
    _stats("critic/advantages", tok, m)
    _stats("critic/returns", tok, m)
    return per_row.float(), m


def tag_step_metrics(
    batch: RefBatch, cfg: Any, step_seconds: float, dp_size: int
) -> dict[str, float]:
    """Stage 9 from tags: the score, length, agent and throughput metrics the ``driver`` plane
    reads off the batch tensors (same names, same values)."""
    from postrl.trainer.metrics import _stats, throughput_from_counts
    from postrl.trainer.stages import _agent_metrics

    s = {k: torch.as_tensor(v) for k, v in batch.scalars.items()}
    valid = s["valid"] > 0
    m: dict[str, Any] = {}
    _stats("critic/score", s["score"][valid], m)
    _stats("critic/rewards", s["score"][valid], m)
    _stats("response_length", s["response_len"], m)
    clip = s["response_len"] >= cfg.rollout.response_length
    m["response_length/clip_ratio"] = float(clip.double().mean()) if len(batch) else 0.0
    _stats("prompt_length", s["prompt_len"], m)
    m.update(_agent_metrics(batch))  # (it reads the non-tensor columns only)
    total = float((s["prompt_len"] + s["response_len"]).sum())
    m.update(throughput_from_counts(total, float(s["policy_tokens"].sum()), step_seconds, dp_size))
    return m
