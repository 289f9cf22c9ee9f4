"""The reward loop: score a batch of trajectories with per-sample isolation and timeouts.

Routing (no name is special-cased): with ``custom_fn_path`` set, every request goes to the
user's function (verl's ``custom_reward_function``); otherwise each request goes to the function
registered for its ``data_source`` in :data:`postrl.reward.registry.REWARD_FNS`, whose metadata
says whether it is a batch function and whether it may run ``inline``.

Isolation:
  * ``inline`` functions (trusted built-in rules) run in the calling thread — microseconds per
    sample. Exceptions, NaN/inf, None and wrong types are caught and counted; a hang cannot be
    interrupted, which is why only trusted rules are inline.
  * all other functions (user code, ``math``) run in a :class:`~postrl.reward.pool.WorkerPool` of
    long-lived spawned processes; a call past ``timeout_s`` has its process killed and replaced,
    a crashed process is replaced, and the sample is counted as ``timeout``/``crash``.

Every sample ends either scored or failed with one reason; the first failure of each reason is
logged (with its traceback for exceptions). ``generated == scored + failed`` holds by
construction. :meth:`RewardLoop.check_failures` enforces ``max_failure_ratio``.

Streaming: :meth:`RewardLoop.submit` scores one request as soon as its trajectory finishes and
returns a future, so scoring overlaps the rollout tail; :meth:`RewardLoop.gather` assembles the
futures into a :class:`~postrl.reward.types.RewardResult`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from postrl.reward.custom import load_custom_reward_fn
from postrl.reward.pool import Outcome, WorkerPool, WorkerPoolError
from postrl.reward.registry import REWARD_FNS
from postrl.reward.types import (
    FAILURE_REASONS,
    RewardError,
    RewardFailureError,
    RewardRequest,
    RewardResult,
    SampleScore,
    classify,
    failed,
)

__all__ = ["RewardLoop"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Route:
    """How to call the function for a group of requests."""

    name: str  # for messages
    fn: Callable[..., Any]
    spec: tuple[str, str, str] | None  # worker spec when not inline
    batch: bool
    inline: bool


class RewardLoop:
    """Scores :class:`RewardRequest` batches; see the module docstring for semantics.

    Args:
        timeout_s: per-call deadline for functions run in worker processes (a batch function's
            whole call gets ``batch_timeout_s``, default ``timeout_s``). Inline functions are
            not interruptible.
        num_workers: worker processes, started on first need and reused across calls.
        custom_fn_path: a ``.py`` file holding the user's function (verl signature); when set it
            scores every request, whatever its data_source.
        custom_fn_name: the function's name in that file.
        custom_fn_batch: the custom function takes lists and returns a list.
        fn_kwargs: extra keyword arguments passed on every call (verl's ``reward_kwargs``),
            e.g. ``{"format_score": 0.1}`` for countdown.
        max_failure_ratio: :meth:`check_failures` raises when failed/generated exceeds it.
        isolate_builtin: run even ``inline`` entries in worker processes (slower, killable).
        start_timeout_s: how long a spawned worker may take to become ready.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        custom_fn_path: str | None = None,
        custom_fn_name: str = "compute_score",
        custom_fn_batch: bool = False,
        fn_kwargs: dict[str, Any] | None = None,
        max_failure_ratio: float = 1.0,
        isolate_builtin: bool = False,
        batch_timeout_s: float | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if not 0.0 <= max_failure_ratio <= 1.0:
            raise ValueError(f"reward.max_failure_ratio must be in [0, 1], got {max_failure_ratio}")
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = float(batch_timeout_s or timeout_s)
        self.num_workers = num_workers
        self.fn_kwargs = dict(fn_kwargs or {})
        self.max_failure_ratio = max_failure_ratio
        self.isolate_builtin = isolate_builtin
        self._pool = WorkerPool(num_workers, start_timeout_s=start_timeout_s)
        self._pool_used = False
        self._routes: dict[str, _Route] = {}
        self._logged: set[str] = set()
        self._custom: _Route | None = None
        if custom_fn_path is not None:
            fn = load_custom_reward_fn(custom_fn_path, custom_fn_name)  # fail fast, here
            self._custom = _Route(
                name=f"custom reward {custom_fn_name!r} from {custom_fn_path}",
                fn=fn,
                spec=("path", str(custom_fn_path), custom_fn_name),
                batch=custom_fn_batch,
                inline=False,
            )

    # ------------------------------------------------------------------ routing
    def has_function(self, data_source: str) -> bool:
        """Whether ``data_source`` is scored by a function here (the custom one, or one registered
        under that name); False means only a reward model can score it."""
        return self._custom is not None or data_source in self._routes or data_source in REWARD_FNS

    def route(self, data_source: str) -> _Route:
        """The route (function + isolation) used for ``data_source``; unknown names raise."""
        if self._custom is not None:
            return self._custom
        if data_source in self._routes:
            return self._routes[data_source]
        fn = REWARD_FNS.get(data_source)
        meta = REWARD_FNS.meta(data_source)
        inline = bool(meta.get("inline", False)) and not self.isolate_builtin
        qualname = getattr(fn, "__qualname__", "")
        spec = None
        if not inline:
            if "<" in qualname or not getattr(fn, "__module__", None):
                raise RewardError(
                    f"reward function for data_source {data_source!r} ({qualname or fn!r}) must "
                    f"run in a worker process but is not importable by name; define it at module "
                    f"level, or register it with inline=True if it is trusted and cannot hang"
                )
            spec = ("ref", fn.__module__, qualname)
        route = _Route(
            name=f"reward function for data_source {data_source!r} ({qualname})",
            fn=fn,
            spec=spec,
            batch=bool(meta.get("batch", False)),
            inline=inline,
        )
        self._routes[data_source] = route
        return route

    def start(self) -> None:
        """Start the worker processes now (otherwise they start on first need)."""
        self._pool_used = True
        self._pool.start()

    # ------------------------------------------------------------------ per-sample path
    def submit(self, request: RewardRequest) -> Future[SampleScore]:
        """Score one request asynchronously; inline functions complete before returning.

        Raises:
            RewardError: the request routes to a batch function (score those with
                :meth:`score`/:meth:`ascore`).
        """
        route = self.route(request.data_source)
        if route.batch:
            raise RewardError(
                f"{route.name} is batch-level; streaming submit() needs a per-sample function, "
                f"use score()/ascore() for the whole batch"
            )
        args = (request.data_source, request.solution_str, request.ground_truth, request.extra_info)
        if route.inline:
            out: Future[SampleScore] = Future()
            out.set_result(self._note(self._call_inline(route, args), request.uid, route))
            return out
        return self._submit_worker(route, args, request.uid)

    def _call_inline(self, route: _Route, args: tuple[Any, ...]) -> SampleScore:
        try:
            value = route.fn(*args, **self.fn_kwargs)
        except Exception as e:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            return failed("exception", tb)
        return classify(value)

    def _submit_worker(self, route: _Route, args: tuple[Any, ...], uid: Any) -> Future[SampleScore]:
        inner = self._pool_submit(route, args, self.timeout_s)
        out: Future[SampleScore] = Future()

        def done(f: Future[Outcome]) -> None:
            try:
                sample = self._from_outcome(f.result())
            except WorkerPoolError as e:
                out.set_exception(RewardError(f"{route.name}: {e}"))
                return
            out.set_result(self._note(sample, uid, route))

        inner.add_done_callback(done)
        return out

    def _pool_submit(
        self, route: _Route, args: tuple[Any, ...], timeout_s: float
    ) -> Future[Outcome]:
        self._pool_used = True
        assert route.spec is not None
        try:
            return self._pool.submit(route.spec, args, self.fn_kwargs, timeout_s)
        except WorkerPoolError as e:
            raise RewardError(f"{route.name}: {e}") from e

    @staticmethod
    def _from_outcome(outcome: Outcome) -> SampleScore:
        if outcome.status == "ok":
            return classify(outcome.value)
        return failed(outcome.status, outcome.error)

    def _note(self, sample: SampleScore, uid: Any, route: _Route) -> SampleScore:
        """Log the first failure of each reason (with its traceback for exceptions)."""
        if sample.reason is not None and sample.reason not in self._logged:
            self._logged.add(sample.reason)
            log.warning(
                "reward failed (%s) for sample uid=%r in %s; later '%s' failures are counted in "
                "reward/failed/%s without logging:\n%s",
                sample.reason,
                uid,
                route.name,
                sample.reason,
                sample.reason,
                sample.detail,
            )
        return sample

    # ------------------------------------------------------------------ batch path
    def score(self, requests: Sequence[RewardRequest]) -> RewardResult:
        """Score every request (order kept); failed samples are marked, never scored 0."""
        samples: list[SampleScore | Future[SampleScore] | None] = [None] * len(requests)
        groups: dict[_Route, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(self.route(req.data_source), []).append(i)
        batch_futures: list[tuple[_Route, list[int], Future[Outcome]]] = []
        for route, idx in groups.items():
            if not route.batch:
                for i in idx:
                    r = requests[i]
                    if route.inline:  # hot path: no future, no thread
                        args = (r.data_source, r.solution_str, r.ground_truth, r.extra_info)
                        samples[i] = self._note(self._call_inline(route, args), r.uid, route)
                    else:
                        samples[i] = self.submit(r)
                continue
            cols = self._columns([requests[i] for i in idx])
            if route.inline:
                self._fill_batch(
                    route, idx, samples, self._call_batch_inline(route, cols), requests
                )
            else:
                fut = self._pool_submit(route, cols, self.batch_timeout_s)
                batch_futures.append((route, idx, fut))
        deadline = self._deadline(len(requests))
        for route, idx, fut in batch_futures:
            self._fill_batch(route, idx, samples, self._wait(fut, deadline, route.name), requests)
        done: list[SampleScore] = []
        for s in samples:
            done.append(self._wait(s, deadline, "reward loop") if isinstance(s, Future) else s)  # type: ignore[arg-type]
        return RewardResult.from_samples(done, [r.uid for r in requests])

    async def ascore(self, requests: Sequence[RewardRequest]) -> RewardResult:
        """:meth:`score` without blocking the event loop (runs in the default executor)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.score, list(requests))

    def gather(
        self, futures: Sequence[Future[SampleScore]], uids: Sequence[Any] | None = None
    ) -> RewardResult:
        """Wait (with a deadline) for futures from :meth:`submit` and assemble the result."""
        deadline = self._deadline(len(futures))
        samples = [self._wait(f, deadline, "reward loop") for f in futures]
        return RewardResult.from_samples(samples, list(uids) if uids is not None else None)

    @staticmethod
    def _columns(reqs: list[RewardRequest]) -> tuple[list[Any], ...]:
        return (
            [r.data_source for r in reqs],
            [r.solution_str for r in reqs],
            [r.ground_truth for r in reqs],
            [r.extra_info for r in reqs],
        )

    def _call_batch_inline(self, route: _Route, cols: tuple[list[Any], ...]) -> Outcome:
        try:
            return Outcome("ok", value=route.fn(*cols, **self.fn_kwargs))
        except Exception:
            return Outcome("exception", error=traceback.format_exc())

    def _fill_batch(
        self,
        route: _Route,
        idx: list[int],
        samples: list[Any],
        outcome: Outcome,
        requests: Sequence[RewardRequest],
    ) -> None:
        if outcome.status != "ok":
            for i in idx:
                samples[i] = self._note(
                    failed(outcome.status, outcome.error), requests[i].uid, route
                )
            return
        values = outcome.value
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if not hasattr(values, "__len__") or isinstance(values, (str, bytes, dict)):
            raise RewardError(
                f"{route.name} is a batch function and must return a list of {len(idx)} scores, "
                f"got {type(values).__name__}"
            )
        if len(values) != len(idx):
            raise RewardError(
                f"{route.name} returned {len(values)} scores for {len(idx)} samples; a batch "
                f"reward function must return exactly one score per input"
            )
        for i, v in zip(idx, values):
            samples[i] = self._note(classify(v), requests[i].uid, route)

    def _deadline(self, n: int) -> float:
        waves = math.ceil(max(n, 1) / self.num_workers) + 1
        slack = self._pool.start_timeout_s if self._pool_used else 0.0
        return time.monotonic() + waves * max(self.timeout_s, self.batch_timeout_s) + slack + 5.0

    @staticmethod
    def _wait(fut: Future[Any], deadline: float, what: str) -> Any:
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout as e:
            raise RewardError(
                f"{what}: no result before the loop deadline; the worker pool is stuck "
                f"(please report this with the log)"
            ) from e
        except WorkerPoolError as e:
            raise RewardError(f"{what}: {e}") from e

    # ------------------------------------------------------------------ failures, lifecycle
    def check_failures(self, result: RewardResult) -> None:
        """Raise :class:`RewardFailureError` when failed/generated > ``max_failure_ratio``."""
        generated = result.metrics["reward/generated"]
        n_failed = result.metrics["reward/failed/total"]
        if generated == 0 or n_failed / generated <= self.max_failure_ratio:
            return
        counts = ", ".join(
            f"{r}={int(result.metrics[f'reward/failed/{r}'])}"
            for r in FAILURE_REASONS
            if result.metrics[f"reward/failed/{r}"]
        )
        first = next(d for d in result.failure_detail if d is not None)
        raise RewardFailureError(
            f"{int(n_failed)}/{int(generated)} samples failed to score "
            f"({n_failed / generated:.1%} > reward.max_failure_ratio={self.max_failure_ratio}): "
            f"{counts}. First error:\n{first}"
        )

    @property
    def pool_stats(self) -> dict[str, int]:
        """Worker-pool counters: processes spawned, killed on timeout, crashed."""
        return dict(self._pool.stats)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._pool.close()

    def __enter__(self) -> RewardLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
