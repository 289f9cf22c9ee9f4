"""The reward stage: every reward source of a trajectory, behind two calls.

:class:`RewardStage` owns the rule/custom reward loop (:class:`~postrl.reward.loop.RewardLoop`),
the learned reward model (any worker group with ``compute_rm_score``), the ``replace`` / ``add``
policy between them, tool rewards and DAPO's overlong shaping. The trainer talks to it through

* :meth:`RewardStage.on_trajectory` — called as each trajectory finishes; a per-sample rule
  starts scoring at once, so scoring overlaps the rollout tail;
* :meth:`RewardStage.finish` — ``finish(batch) -> (batch, metrics)``: the streamed scores are
  collected, every row not streamed is scored now, the sources are combined and the batch gets
  ``token_level_scores`` (the score on the last response token) and ``sample_valid``.

How one row's score is made (B rows; every step is a column operation)::

    rule   (B,)  rule/custom function (streamed rows ∪ rows scored in finish, scattered by row);
                 a row whose agent loop scored it (agent_extra["reward"]: an environment's
                 return, an agent's reported reward) takes that score and calls no function
    rm     (B,)  reward-model score × reward.model.weight            (when reward.model.enable)
    score  = rm                 (mode=replace: no rule function is called)
           | rule + rm          (mode=add)
           | rule               (no reward model)
    score += tool_reward_weight × Σ tool rewards of the trajectory   (reward_delta + calc_reward)
    score += overlong penalty                                         (reward.overlong.enable)

A trajectory's ``segments`` (rows with ``segment > 0``) are not scored: each takes the
score of its trajectory's own row (same ``uid`` and ``sample_index``).

A failed row (rule failure, non-finite reward-model score) stays failed through every step: its
score is a 0 placeholder no estimator reads, ``sample_valid`` is False and its
``response_mask`` is zeroed. :meth:`RewardLoop.check_failures` enforces
``reward.max_failure_ratio`` on the combined result.

Streamed futures are keyed by ``(uid, sample_index)``, not by batch position, so a batch may be
reordered or assembled from trajectories of several rollouts (async modes) before ``finish``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from postrl.algos import overlong_reward_penalty
from postrl.protocol import DataProto
from postrl.protocol.layout import segment_parents
from postrl.reward.loop import RewardLoop
from postrl.reward.types import RewardRequest, RewardResult, SampleScore, classify, failed

logger = logging.getLogger(__name__)

__all__ = [
    "RewardStage",
    "build_reward_stage",
    "RewardModelScorer",
    "StreamedScores",
    "apply_reward_result",
    "shape_scores",
    "write_scores",
    "combine_scores",
    "decode_responses",
]


class RewardModelScorer(Protocol):
    """A learned reward model as the stage sees it (e.g. the ``RewardModelWorker`` group)."""

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B,) raw scores and ``rm_truncated`` (B,) bool for the rows of ``data``."""
        ...


@dataclass
class StreamedScores:
    """Trajectories scored without their batch (:meth:`RewardStage.score_streamed`).

    Attributes:
        scores: (B,) float32, each row's final score (shaping included; 0 where invalid).
        valid: (B,) bool, False for a failed row.
        metrics: the reward metrics :meth:`RewardStage.finish` reports for these rows.
    """

    scores: torch.Tensor
    valid: torch.Tensor
    metrics: dict[str, float]

    def apply(self, batch: DataProto) -> DataProto:
        """The rows' assembled batch (same rows, same order) with the scores written as
        :meth:`RewardStage.finish` writes them."""
        return write_scores(batch, self.scores, self.valid)


def decode_responses(tokenizer: Any, batch: DataProto) -> list[str]:
    """Decode every response (padding stripped; special tokens skipped)."""
    responses = batch.batch["responses"]
    lengths = batch.batch["attention_mask"][:, -responses.shape[1] :].sum(-1).tolist()
    ids = [row[:n] for row, n in zip(responses.tolist(), lengths)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


class RewardStage:
    """Rule/custom rewards, the reward model, tool rewards and shaping of one run.

    Args:
        loop: the rule/custom reward loop (owned: :meth:`close` closes it).
        tokenizer: the policy tokenizer (responses are decoded for rule functions).
        reward_model: a :class:`RewardModelScorer`, or None.
        rm_mode: ``replace`` (the reward-model score is the reward) or ``add``.
        rm_weight: multiplier of the reward-model score.
        rm_max_length: the reward model's token budget (named in the truncation warning).
        overlong: DAPO overlong-shaping options (``enable``, ``buffer_len``, ``penalty_factor``)
            or None.
        max_response_length: the configured response limit the overlong ramp ends at.
        tool_reward_weight: multiplier of a trajectory's summed tool rewards.
    """

    def __init__(
        self,
        loop: RewardLoop,
        tokenizer: Any,
        *,
        reward_model: RewardModelScorer | None = None,
        rm_mode: str = "replace",
        rm_weight: float = 1.0,
        rm_max_length: int = 0,
        overlong: Any = None,
        max_response_length: int | None = None,
        tool_reward_weight: float = 1.0,
    ) -> None:
        if rm_mode not in ("replace", "add"):
            raise ValueError(f"reward.model.mode must be 'replace' or 'add', got {rm_mode!r}")
        self.loop = loop
        self.tokenizer = tokenizer
        self.reward_model = reward_model
        self.rm_mode = rm_mode
        self.rm_weight = float(rm_weight)
        self.rm_max_length = rm_max_length
        self.overlong = overlong
        self.max_response_length = max_response_length
        self.tool_reward_weight = float(tool_reward_weight)
        self._pending: dict[tuple[Any, int], Future[SampleScore]] = {}

    @property
    def rule_functions(self) -> bool:
        """Whether rule/custom functions are called (False with a reward model in ``replace``)."""
        return self.reward_model is None or self.rm_mode == "add"

    def has_function(self, data_source: str) -> bool:
        """Whether a rule/custom function scores ``data_source`` (else only a reward model can)."""
        return self.loop.has_function(str(data_source))

    # ------------------------------------------------------------------ streaming
    def on_trajectory(self, i: int, output: Any, row: dict[str, Any]) -> None:
        """Per finished trajectory (``AgentLoopManager``'s ``on_sample_end``): submit a
        per-sample rule at once; batch functions and the reward model wait for :meth:`finish`."""
        if "reward" in (getattr(output, "extra", None) or {}):
            return  # the loop scored its own trajectory (rule_scores reads agent_extra)
        if not self.rule_functions or self.loop.route(str(row["data_source"])).batch:
            return
        request = RewardRequest(
            data_source=str(row["data_source"]),
            solution_str=_solution(self.tokenizer, output.response_ids, output.extra),
            ground_truth=row["ground_truth"],
            extra_info=dict(row.get("extra_info") or {}),
            uid=row.get("uid"),
        )
        self._pending[(row["uid"], int(row["sample_index"]))] = self.loop.submit(request)

    # ------------------------------------------------------------------ batch
    def streamed(self, keys: list[tuple[Any, int]]) -> list[Future[SampleScore]]:
        """The pending streamed futures of ``(uid, sample_index)`` keys (those submitted by
        :meth:`on_trajectory` and not yet collected), e.g. to await them before :meth:`finish`."""
        return [self._pending[k] for k in keys if k in self._pending]

    def finish(
        self, batch: DataProto, *, check_failures: bool = True
    ) -> tuple[DataProto, dict[str, float]]:
        """Score every row of ``batch`` and write ``token_level_scores`` / ``sample_valid``.

        A batch that is already scored (``token_level_scores`` present: the mode scored it to
        filter groups) passes through unchanged, with no metrics (the mode reported them).
        ``check_failures=False``: do not enforce ``reward.max_failure_ratio`` here (a replay
        buffer evicts and refills the groups past it instead)."""
        if "token_level_scores" in batch.batch:
            return batch, {}
        metrics: dict[str, float] = {}
        parents = segment_parents(batch.non_tensor_batch)
        own = None if parents is None else [i for i, p in enumerate(parents) if p == i]
        scored = batch if own is None else batch[own]  # segment rows share their run's score
        rule = self.rule_scores(scored) if self.rule_functions else None
        rm = None
        if self.reward_model is not None:
            t0 = time.perf_counter()
            raw, metrics = self.rm_scores(scored)
            rm = raw * self.rm_weight
            metrics["timing_s/reward_model"] = time.perf_counter() - t0
        result = combine_scores(rule, rm, list(scored.non_tensor_batch["uid"]))
        result, tm = self._add_tool_rewards(scored.non_tensor_batch.get("agent_extra"), result)
        if parents is not None:
            assert own is not None
            pos = {row: j for j, row in enumerate(own)}
            result = _take(result, [pos[p] for p in parents])
        metrics.update(tm)
        if check_failures:
            self.loop.check_failures(result)
        batch, am = apply_reward_result(
            batch, result, self.overlong, max_response_length=self.max_response_length
        )
        metrics.update(am)
        return batch, metrics

    def score_streamed(
        self, outputs: list[Any], rows: list[dict[str, Any]]
    ) -> StreamedScores | None:
        """Score finished trajectories without their padded batch, as :meth:`finish` would
        score it (``check_failures=False``): when every row's rule score was streamed by
        :meth:`on_trajectory` or is its loop's own, no reward model scores them and none has
        ``segments``. The batch is then needed only for a group that is trained, not for one a
        filter evicts (``StreamedScores.apply`` writes the scores into it when it is built).
        None when the batch is needed to score them (call :meth:`finish` on it).

        Args:
            outputs: the trajectories' ``AgentLoopOutput``.
            rows: their rows (``uid``, ``sample_index``, ``data_source``, …).
        """
        if self.reward_model is not None or any(o.segments for o in outputs):
            return None
        extras = [o.extra for o in outputs]
        keys = [(r["uid"], int(r["sample_index"])) for r in rows]
        if any(k not in self._pending and "reward" not in (e or {}) for k, e in zip(keys, extras)):
            return None  # a row to decode and score now: finish scores it from the batch
        nt = {
            "uid": [r["uid"] for r in rows],
            "sample_index": [r["sample_index"] for r in rows],
            "agent_extra": extras,
        }
        result = self._rule_scores(nt, len(rows), None)
        result, metrics = self._add_tool_rewards(extras, result)
        resp_len = torch.tensor([len(o.response_ids) for o in outputs], dtype=torch.long)
        scores, am = shape_scores(result, resp_len, self.overlong, self.max_response_length)
        metrics.update(am)
        return StreamedScores(scores, result.valid, metrics)

    def rule_scores(self, batch: DataProto) -> RewardResult:
        """Rule/custom scores of every row: a loop's own score where its trajectory carries one
        (``agent_extra[i]["reward"]``: environments, agents that report a reward; no function is
        called), streamed futures where present, the rest now."""
        return self._rule_scores(batch.non_tensor_batch, len(batch), batch)

    def _rule_scores(self, nt: dict[str, Any], n: int, batch: DataProto | None) -> RewardResult:
        """:meth:`rule_scores` from the rows' non-tensor columns ``nt``; ``batch`` (its tensors
        decode the rows neither streamed nor scored by their loop) may be None when there are
        none."""
        keys = list(zip(nt["uid"], (int(k) for k in nt.get("sample_index", [0] * n))))
        extras = nt.get("agent_extra", [None] * n)
        own = [i for i in range(n) if "reward" in (extras[i] or {})]
        mine = set(own)
        streamed = [i for i, key in enumerate(keys) if key in self._pending and i not in mine]
        missing = [i for i, key in enumerate(keys) if key not in self._pending and i not in mine]
        parts: list[tuple[list[int], RewardResult]] = []
        if own:
            samples = [_own_score(extras[i]["reward"]) for i in own]
            parts.append((own, RewardResult.from_samples(samples, [nt["uid"][i] for i in own])))
        if streamed:
            futures = [self._pending.pop(keys[i]) for i in streamed]
            parts.append((streamed, self.loop.gather(futures, [nt["uid"][i] for i in streamed])))
        if missing:
            assert batch is not None, "rows to decode need their batch"
            sub = batch if len(missing) == n else batch[missing]
            texts = decode_responses(self.tokenizer, sub)
            extras = nt.get("agent_extra")
            if extras is not None:  # a loop's own answer text (the gateway's final message)
                texts = [_solution(None, t, extras[i]) for t, i in zip(texts, missing)]
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
            parts.append((missing, self.loop.score(reqs)))
        return parts[0][1] if len(parts) == 1 else RewardResult.scatter(n, parts)

    def rm_scores(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """Raw reward-model scores (B,) of every row and their metrics."""
        assert self.reward_model is not None, "rm_scores needs reward.model.enable"
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
                "reward model: %d of %d conversations exceeded reward.model.max_length=%d and "
                "kept their last tokens",
                int(cut.sum()),
                len(cut),
                self.rm_max_length,
            )
        return scores, metrics

    def _add_tool_rewards(
        self, extras: Any, result: RewardResult
    ) -> tuple[RewardResult, dict[str, float]]:
        if extras is None or not any("tool_reward" in (e or {}) for e in extras):
            return result, {}
        tool = torch.tensor(
            [float((e or {}).get("tool_reward", 0.0)) for e in extras], dtype=torch.float32
        )  # (B,)
        metrics = {"reward/tool_reward/mean": float(tool.mean())}
        if self.tool_reward_weight == 0.0 or not bool(tool.any()):
            return result, metrics
        scores = result.scores + self.tool_reward_weight * tool
        return RewardResult.from_columns(
            scores, result.failure_reason, result.failure_detail, result.extra, result.uids
        ), metrics

    def close(self) -> None:
        """Stop the reward worker processes; unfinished streamed futures are dropped."""
        self._pending.clear()
        self.loop.close()


def _own_score(value: Any) -> SampleScore:
    """A trajectory's own score (``AgentLoopOutput.extra["reward"]``: a number or a dict with
    ``score``, validated like a reward function's return value; ``{"error": text}``: the loop
    failed to score it, a failed sample with reason ``exception``)."""
    if isinstance(value, dict) and "error" in value:
        return failed("exception", str(value["error"]))
    return classify(value)


def _solution(tokenizer: Any, response: Any, extra: Any) -> str:
    """The text a rule function scores: the loop's ``extra["solution_str"]`` when it gives one
    (the ``gateway`` loop: the agent's final assistant message), else the decoded response
    (``response``: ids with a ``tokenizer``, or text already decoded)."""
    text = (extra or {}).get("solution_str") if isinstance(extra, dict) else None
    if text is not None:
        return str(text)
    if tokenizer is None:
        return str(response)
    return tokenizer.decode(response, skip_special_tokens=True)


def _take(result: RewardResult, rows: list[int]) -> RewardResult:
    """``result``'s rows in the order ``rows`` (repeats allowed)."""
    return RewardResult.from_columns(
        result.scores[torch.as_tensor(rows, dtype=torch.long)],
        [result.failure_reason[i] for i in rows],
        [result.failure_detail[i] for i in rows],
        {k: [v[i] for i in rows] for k, v in result.extra.items()},
        [result.uids[i] for i in rows],
    )


def combine_scores(
    rule: RewardResult | None, rm: torch.Tensor | None, uids: list[Any]
) -> RewardResult:
    """``replace`` (rule is None), ``add`` (both) or rule only, column by column. A non-finite
    reward-model score fails its row (``nan``); a row whose rule failed stays failed."""
    if rm is None:
        assert rule is not None
        return rule
    ok = torch.isfinite(rm)  # (B,)
    rm_reason = [None if v else "nan" for v in ok.tolist()]
    rm_detail = [
        None if v else f"reward model: score is {s}" for v, s in zip(ok.tolist(), rm.tolist())
    ]
    if rule is None:
        return RewardResult.from_columns(torch.where(ok, rm, 0.0), rm_reason, rm_detail, {}, uids)
    reasons = [r if r is not None else m for r, m in zip(rule.failure_reason, rm_reason)]
    details = [
        d if r is not None else md
        for r, d, md in zip(rule.failure_reason, rule.failure_detail, rm_detail)
    ]
    scores = rule.scores + torch.where(ok, rm, 0.0)
    return RewardResult.from_columns(scores, reasons, details, rule.extra, uids)


def apply_reward_result(
    batch: DataProto,
    result: RewardResult,
    overlong: Any | None = None,
    max_response_length: int | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """Write ``token_level_scores`` (score on the last response token) and ``sample_valid``.

    Failed samples keep a 0 placeholder that no estimator reads: they are excluded from their
    group's baseline via ``sample_valid`` and their ``response_mask`` is zeroed (no loss).

    With ``overlong.enable`` (DAPO soft overlong punishment) the penalty ramps over the last
    ``overlong.buffer_len`` tokens before ``max_response_length`` — the *configured* maximum
    (``rollout.response_length``), passed here or as ``meta_info["max_response_length"]``. The
    batch's own width cannot stand in for it: responses are padded to the longest one of the
    batch, so a batch of short answers would be punished for lengths far below the limit.
    """
    if max_response_length is None:
        max_response_length = batch.meta_info.get("max_response_length")
    resp_len = _response_lengths(batch)
    scores, metrics = shape_scores(result, resp_len, overlong, max_response_length)
    return write_scores(batch, scores, result.valid, resp_len), metrics


def shape_scores(
    result: RewardResult,
    resp_len: torch.Tensor,
    overlong: Any | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The rows' final scores (B,) float32 — ``result.scores`` plus the overlong penalty of
    their response lengths ``resp_len`` (B,) when ``overlong.enable`` — and the metrics
    :func:`apply_reward_result` reports: the result's counts, the penalty's mean and the mean of
    each numeric ``extra`` key."""
    scores = result.scores.clone()
    metrics = dict(result.metrics)
    if overlong is not None and getattr(overlong, "enable", False):
        if max_response_length is None:
            raise ValueError(
                "reward.overlong.enable=True needs the configured maximum response length: call "
                "apply_reward_result(..., max_response_length=cfg.rollout.response_length) or "
                "set batch.meta_info['max_response_length'] (the padded batch width is not the "
                "limit)"
            )
        penalty = overlong_reward_penalty(
            resp_len, int(max_response_length), overlong.buffer_len, overlong.penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty/mean"] = float(penalty.float().mean())
    for k, vals in result.extra.items():
        nums = [float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if nums:
            metrics[f"reward/extra/{k}/mean"] = sum(nums) / len(nums)
    return scores, metrics


def write_scores(
    batch: DataProto,
    scores: torch.Tensor,
    valid: torch.Tensor,
    resp_len: torch.Tensor | None = None,
) -> DataProto:
    """A copy of ``batch`` with ``token_level_scores`` (each row's score (B,) on its last
    response token), ``sample_valid`` (B,) and the failed rows' ``response_mask`` zeroed
    (``resp_len``: the rows' response lengths, when already computed)."""
    b = dict(batch.batch)
    tls = torch.zeros_like(b["responses"], dtype=torch.float32)
    if resp_len is None:
        resp_len = _response_lengths(batch)
    last = (resp_len - 1).clamp(min=0)
    tls[torch.arange(tls.shape[0]), last] = scores
    valid = valid.clone()
    b["token_level_scores"] = tls
    b["sample_valid"] = valid
    b["response_mask"] = b["response_mask"] * valid[:, None].to(b["response_mask"].dtype)
    return DataProto(b, dict(batch.non_tensor_batch), dict(batch.meta_info))


def _response_lengths(batch: DataProto) -> torch.Tensor:
    """Each row's response length (B,): its response part's attention-mask sum."""
    R = batch.batch["responses"].shape[1]
    return batch.batch["attention_mask"][:, -R:].sum(-1)


def build_reward_stage(cfg: Any, tokenizer: Any, reward_model: Any = None) -> RewardStage:
    """The run's :class:`RewardStage` from the ``reward.*`` section of the RL config ``cfg``
    (and ``rollout.response_length`` for overlong shaping): the trainer's, and in the
    object-store data plane each rollout replica's own. ``reward_model``: the reward-model
    worker group when ``reward.model.enable``."""
    rw = cfg.reward
    loop = RewardLoop(
        timeout_s=rw.timeout_s,
        num_workers=rw.num_workers,
        custom_fn_path=rw.custom_function.path or None,
        custom_fn_name=rw.custom_function.name,
        custom_fn_batch=rw.custom_function.batch,
        fn_kwargs=rw.reward_kwargs,
        max_failure_ratio=rw.max_failure_ratio,
        isolate_builtin=rw.isolate_builtin,
    )
    return RewardStage(
        loop,
        tokenizer,
        reward_model=reward_model,
        rm_mode=rw.model.mode,
        rm_weight=rw.model.weight,
        rm_max_length=rw.model.max_length,
        overlong=rw.overlong,
        max_response_length=cfg.rollout.response_length,
        tool_reward_weight=rw.tool_reward_weight,
    )
