"""Replicas, load balancing and the resuming client that agent loops talk to.

- ``RolloutReplica`` wraps one backend instance in-process: tracks in-flight requests, the policy
  version of its weights, and a pause gate used around weight updates (``pause`` aborts every
  in-flight request and holds new ones until ``resume``).
- ``LoadBalancer`` routes to the least-loaded replica, sticky per trajectory id (the turns of one
  multi-turn sample reach the same replica, so its KV/prefix state can be reused).
- ``RolloutClient.generate`` hides interruptions: when a request comes back ``"abort"`` because
  its replica paused for a weight update, the client re-sends prompt + partial output and
  concatenates tokens and log-probs; every segment records ``(num_tokens, policy_version)`` in
  ``TokenOutput.versions``. Aborts requested through ``RolloutClient.abort`` are final.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from postrl.rollout.checksum import PROBE_PREFIX, ReceivedWeights
from postrl.rollout.signal import Signal
from postrl.rollout.types import (
    ReplicaDeadError,
    RolloutError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

if TYPE_CHECKING:
    from postrl.weights import Bucket

__all__ = ["RolloutReplica", "LoadBalancer", "RolloutClient"]

logger = logging.getLogger(__name__)


class RolloutReplica:
    """One backend instance served in-process.

    Weight updates reach the backend atomically when it supports swaps (``begin_weight_swap`` /
    ``end_weight_swap``, the native engine): a multi-bucket update (``receive_bucket``) or a
    whole stream (``update_weights``) is copied while the engine is held, in-flight requests keep
    running across it, and their ``TokenOutput.versions`` are the engine's exact per-token
    segments. Other backends copy bucket by bucket as they arrive, and their results are labelled
    with the replica's version at request start (exact when updates happen under ``pause``).

    Args:
        backend: any ``RolloutBackend``.
        replica_id: index used in logs and routing.
        pause_timeout_s: how long a request waits on a paused replica before failing.
        cores: a :class:`~postrl.protocol.cores.CoreOwner` when this replica lends its cores
            to the trainer while it has no request in flight (a replica process beside the
            trainer, ``trainer.lend_cores``): the first request claims them back.
        shared_dir: the directory whose :class:`~postrl.weights.buckets.SharedWeightBuffer`
            files this replica may map (:meth:`receive_shared_bucket_report`: a replica process
            beside the trainer); None: it accepts weights as frames only.
    """

    def __init__(
        self,
        backend: Any,
        replica_id: int = 0,
        pause_timeout_s: float = 600.0,
        cores: Any = None,
        shared_dir: str | None = None,
    ) -> None:
        self.backend = backend
        self.cores = cores
        self.shared_dir = shared_dir
        self._shared_maps: dict[str, Any] = {}  # shared weight buffers mapped, kept mapped
        self.replica_id = replica_id
        self.policy_version = 0
        self.pause_timeout_s = pause_timeout_s
        self.standby = False
        """Out of service without being dead: the load balancer routes nothing to it, and a
        request that still reaches it comes back at once as ``"abort"`` with no tokens (the
        client re-issues it elsewhere). The trainer's idle switch keeps its in-process replica
        so between two switches."""
        self.last_swap: dict[str, float] = {}
        """Metrics of the last atomic weight swap (``pause_s``, ``recompute_s``, ``running``)."""
        self.received = ReceivedWeights()
        """Per-tensor checksums of what this replica loaded (the weight-sync contract)."""
        self._inflight: set[str] = set()
        self._paused = False
        self._changed = Signal()  # pause/resume, and the last in-flight request leaving
        self._swap_open = False  # this replica opened a backend swap (multi-bucket update)
        self._swaps = callable(getattr(backend, "begin_weight_swap", None)) and callable(
            getattr(backend, "end_weight_swap", None)
        )

    @property
    def load(self) -> int:
        """Number of in-flight requests (the load balancer's metric)."""
        return len(self._inflight)

    @property
    def dead(self) -> bool:
        """Always False: an in-process replica lives as long as its trainer."""
        return False

    @property
    def dead_reason(self) -> str | None:
        """Always None (see :attr:`dead`)."""
        return None

    def close(self) -> None:
        """Close the backend (engines with processes or threads of their own shut them down)."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Run one request on the backend (waits while the replica is paused).

        ``out.versions``: the backend's segments when it supports swaps and they cover every
        token, else one segment with the replica's version at request start.
        """
        if self.standby:
            return TokenOutput([], [], "abort", None, [])
        if (  # the wait (a coroutine, a deadline) only while paused: the per-request hot path
            self._paused
            and not request_id.startswith(PROBE_PREFIX)
            and not await self._changed.wait_for(
                lambda: not self._paused or request_id.startswith(PROBE_PREFIX),
                self.pause_timeout_s,
            )
        ):
            raise RolloutTimeoutError(
                f"replica {self.replica_id} stayed paused > {self.pause_timeout_s}s; "
                f"call resume() after the weight update or raise pause_timeout_s"
            )
        self._inflight.add(request_id)
        version = self.policy_version  # without swaps an update only happens while paused,
        try:  # after ``pause`` aborted this call
            if self.cores:
                async with self.cores.working():
                    out = await self.backend.generate(prompt_ids, sampling, request_id)
            else:
                out = await self.backend.generate(prompt_ids, sampling, request_id)
        finally:
            self._inflight.discard(request_id)
            if not self._inflight:
                self._changed.notify()  # (drained)
        n = len(out.token_ids)
        if not (self._swaps and out.versions and sum(c for c, _ in out.versions) == n):
            out.versions = [(n, version)]
        return out

    def abort(self, request_id: str) -> None:
        """Abort one request (partial output returned to its caller)."""
        self.backend.abort(request_id)

    def pause(self) -> None:
        """Abort all in-flight requests and hold new ones (clients resume them after ``resume``)."""
        self._paused = True
        for rid in list(self._inflight):
            self.backend.abort(rid)

    def resume(self) -> None:
        """Serve again after ``pause``."""
        self._paused = False
        self._changed.notify()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (e.g. the aborted ones after :meth:`pause` came
        back); False if some still are after ``timeout_s``."""
        return await self._changed.wait_for(lambda: not self._inflight, timeout_s)

    def update_weights(self, weights: Iterable[WeightItem], version: int | None = None) -> None:
        """Load new weights and set the policy version (default: previous + 1).

        Swap-capable backends get one atomic swap (``last_swap`` records its metrics); others get
        ``update_weights(weights, version=...)`` when they accept ``version``, else
        ``update_weights(weights)``.
        """
        new = self.policy_version + 1 if version is None else int(version)
        self.received.begin()
        weights = self.received.track(weights)
        if self._swaps:
            self._load_in_swap(weights, close_at=new)
        elif self._accepts_version(self.backend.update_weights):
            self.backend.update_weights(weights, version=new)
        else:
            self.backend.update_weights(weights)
        self.received.end()
        self.policy_version = new

    @property
    def last_received(self) -> dict[str, int]:
        """``{name: crc32}`` of the tensors of the last complete weight update."""
        return self.received.last

    @property
    def max_model_len(self) -> int | None:
        """Tokens per sequence the engine holds, where the backend says (else None)."""
        n = getattr(self.backend, "max_model_len", None)
        return int(n) if n else None

    def status(self) -> dict[str, Any]:
        """The health answer remote callers get: policy version, running / waiting requests,
        the engine's busy seconds and the seconds spent waiting for lent cores (what the watchdog
        reads)."""
        be = self.backend
        return {
            "status": "ok",
            "policy_version": self.policy_version,
            "running": int(getattr(be, "num_running", 0)),
            "waiting": int(getattr(be, "num_waiting", 0)),
            "busy_s": float(getattr(be, "busy_s", 0.0)),
            "core_wait_s": float(self.cores.waited_s) if self.cores is not None else 0.0,
        }

    def receive_bucket_report(self, frame: bytes | Bucket) -> dict[str, Any]:
        """:meth:`receive_bucket`, then the answer a remote sender gets: the policy version and,
        at an update's last frame, the swap's metrics (``swap``)."""
        last = self.receive_bucket(frame)
        out: dict[str, Any] = {"policy_version": self.policy_version}
        if last and self.last_swap:
            out["swap"] = dict(self.last_swap)
        if last:
            out["received"] = self.received.last
        return out

    def receive_shared_bucket_report(self, shm: dict[str, Any], header: dict) -> dict[str, Any]:
        """:meth:`receive_bucket_report` of a bucket the trainer packed into a
        :class:`~postrl.weights.buckets.SharedWeightBuffer` (``shm``: its file's ``name`` in
        :attr:`shared_dir`, ``offset``, ``nbytes``); ``ValueError`` for a file outside that
        directory or a range outside the file."""
        from postrl.weights.buckets import map_shared_bucket

        name = str(shm.get("name", ""))
        if not self.shared_dir or not name or os.path.basename(name) != name:
            raise ValueError(
                f"shared weight buffer {name!r} refused: this replica maps only files directly "
                f"in its shared directory ({self.shared_dir!r})"
            )
        path = os.path.join(self.shared_dir, name)
        bucket = map_shared_bucket(
            header, path, int(shm["offset"]), int(shm["nbytes"]), self._shared_maps
        )
        return self.receive_bucket_report(bucket)

    def receive_bucket(self, frame: bytes | Bucket) -> bool:
        """Load one ``postrl.weights`` bucket frame (raw bytes + JSON header, never unpickled;
        or a decoded :class:`~postrl.weights.buckets.Bucket`); returns whether it was an
        update's last frame.

        On a swap-capable backend the first bucket of an update opens a swap and the ``last``
        one closes it with the header's ``version`` (default: previous + 1), so the engine never
        steps on half-updated weights; a bucket that fails to load closes the swap without
        changing the version, then raises.
        """
        from postrl.weights import Bucket, decode_frame, unpack_bucket

        bucket = frame if isinstance(frame, Bucket) else decode_frame(frame)
        items = unpack_bucket(bucket)  # validates the header before the engine is held
        if int(bucket.header.get("index", 0)) == 0:
            self.received.begin()
        items = list(self.received.track(items))
        last = bool(bucket.header.get("last"))
        v = bucket.header.get("version")
        new = self.policy_version + 1 if v is None else int(v)
        if not self._swaps:
            self.backend.update_weights(items)
        else:
            self._load_in_swap(items, close_at=new if last else None)
        if last:
            self.received.end()
            self.policy_version = new
        return last

    def _load_in_swap(self, weights: Iterable[WeightItem], close_at: int | None) -> None:
        """Copy ``weights`` inside this replica's swap (opened if none is), then close it at
        version ``close_at`` (None: leave it open for the update's next bucket). A load that
        raises closes the swap at the current version, then re-raises."""
        if not self._swap_open:
            self.backend.begin_weight_swap()
            self._swap_open = True
        try:
            self.backend.update_weights(weights)
        except BaseException:
            self._close_swap(self.policy_version)  # the swap closes, the version stays
            raise
        if close_at is not None:
            self._close_swap(close_at)

    def _close_swap(self, version: int) -> None:
        """End the swap this replica opened at ``version``; keep its metrics in ``last_swap``."""
        self._swap_open = False
        self.last_swap = dict(self.backend.end_weight_swap(version) or {})

    @staticmethod
    def _accepts_version(fn: Any) -> bool:
        """Whether ``fn`` takes a ``version`` keyword (or ``**kwargs``)."""
        import inspect

        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.name == "version" or p.kind is p.VAR_KEYWORD for p in params)

    def sleep(self) -> None:
        """Release the backend's KV cache (aborts in-flight requests)."""
        self.backend.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released."""
        self.backend.wake_up(tags)


class LoadBalancer:
    """Least-loaded routing with sticky trajectories.

    Args:
        replicas: objects with ``load`` (int) and async ``generate``.
        max_sticky: how many trajectory → replica assignments to remember (LRU).
    """

    def __init__(self, replicas: list[Any], max_sticky: int = 100_000) -> None:
        if not replicas:
            raise ValueError("LoadBalancer needs at least one replica")
        self.replicas = list(replicas)
        self.max_sticky = max_sticky
        self.restart_expected: Callable[[], bool] | None = None
        """``() -> bool``, set by whoever restarts replicas: while it is true and no replica
        is live, requests wait (up to :attr:`restart_wait_s`) instead of failing."""
        self.restart_wait_s = 300.0
        self.changed = Signal()
        """Notified when the replicas change (:meth:`add`, :meth:`replace`) or a restart that
        requests may wait for failed: wakes :func:`_await_restart`."""
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._assigned = [0] * len(replicas)  # requests routed and not yet released

    def pick(self, trajectory_id: str | None = None) -> int:
        """Index of the replica to use: the trajectory's replica if known and alive, else the
        least loaded live one (``ReplicaDeadError`` when every replica is dead)."""
        if trajectory_id is not None and trajectory_id in self._sticky:
            idx = self._sticky[trajectory_id]
            if _serving(self.replicas[idx]):
                self._sticky.move_to_end(trajectory_id)
                return idx
            del self._sticky[trajectory_id]
        live = self.live
        if not live:
            reasons = "; ".join(
                f"{i}: {r.dead_reason or 'standby'}" for i, r in enumerate(self.replicas)
            )
            raise ReplicaDeadError(-1, f"no rollout replica is left ({reasons})")
        idx = min(live, key=lambda i: (self._assigned[i] + self.replicas[i].load, i))
        if trajectory_id is not None:
            self._sticky[trajectory_id] = idx
            if len(self._sticky) > self.max_sticky:
                self._sticky.popitem(last=False)
        return idx

    @property
    def live(self) -> list[int]:
        """Indices of the replicas that take requests: not declared dead, not on standby."""
        return [i for i, r in enumerate(self.replicas) if _serving(r)]

    def add(self, replica: Any) -> int:
        """Route to one more replica from now on (e.g. the trainer's idle-switch replica, kept
        on ``standby`` between switches); returns its index."""
        self.replicas.append(replica)
        self._assigned.append(0)
        self.changed.notify()
        return len(self.replicas) - 1

    def replace(self, idx: int, replica: Any) -> None:
        """Route to ``replica`` in slot ``idx`` from now on (a restarted replica in place of a
        dead one; requests still counted against the old one release as they fail)."""
        self.replicas[idx] = replica
        self.changed.notify()

    def acquire(self, idx: int) -> None:
        """Count a request routed to replica ``idx`` (before it reaches the replica)."""
        self._assigned[idx] += 1

    def release(self, idx: int) -> None:
        """Undo ``acquire``."""
        self._assigned[idx] -= 1

    def forget(self, trajectory_id: str) -> None:
        """Drop a finished trajectory's sticky assignment."""
        self._sticky.pop(trajectory_id, None)


def _serving(replica: Any) -> bool:
    """Whether ``replica`` takes new requests (not ``dead``, not on ``standby``)."""
    return not replica.dead and not replica.standby


async def _await_restart(lb: LoadBalancer, err: ReplicaDeadError) -> None:
    """No replica is live: return once one is, or raise ``err`` when no restart is expected
    (``lb.restart_expected``) or none came within ``lb.restart_wait_s``."""
    expected = lb.restart_expected
    if expected is None or not expected():
        raise err
    if not await lb.changed.wait_for(lambda: bool(lb.live) or not expected(), lb.restart_wait_s):
        raise err
    if not lb.live:  # the restart failed and none is left to come
        raise err


def _segment_seed(seed: int | None, segment: int) -> int | None:
    if seed is None or segment == 0:
        return seed
    h = hashlib.blake2b(f"{seed}:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


class RolloutClient:
    """What agent loops call: ``await client.generate(prompt_ids, sampling, request_id)``.

    Args:
        target: a ``LoadBalancer``, a replica (``RolloutReplica``, ``RayRolloutReplica``: anything
            with ``load``) or a bare backend (wrapped in a ``RolloutReplica``).
        max_segments: most resumes of one request before giving up (typed error).
        timeout_s: deadline of one whole ``generate`` call (None = no deadline).
    """

    def __init__(self, target: Any, max_segments: int = 64, timeout_s: float | None = None) -> None:
        if isinstance(target, LoadBalancer):
            self.balancer = target
        elif isinstance(target, RolloutReplica) or hasattr(
            target, "load"
        ):  # a replica (local or Ray)
            self.balancer = LoadBalancer([target])
        else:
            self.balancer = LoadBalancer([RolloutReplica(target)])
        self.max_segments = max_segments
        self.timeout_s = timeout_s
        self._cancelled: set[str] = set()
        self._current: dict[str, tuple[Any, str, str]] = {}  # request → (replica, seg, sticky)
        self.reissued = 0
        """Requests re-issued to another replica after theirs died."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        trajectory_id: str | None = None,
    ) -> TokenOutput:
        """Generate, transparently resuming across replica pauses (see module docstring)."""
        coro = self._generate(list(prompt_ids), sampling, request_id, trajectory_id)
        if self.timeout_s is None:
            return await coro
        # not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that lands in the
        # iteration the request completes, so an evicted trajectory would run on
        task = asyncio.ensure_future(coro)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            await asyncio.wait({task})
            raise RolloutTimeoutError(f"request {request_id!r} exceeded timeout_s={self.timeout_s}")
        return task.result()

    def abort(self, request_id: str) -> None:
        """Abort a request for good: its ``generate`` returns the partial output ("abort")."""
        self._cancelled.add(request_id)
        cur = self._current.get(request_id)
        if cur is not None:
            cur[0].abort(cur[1])

    def shed(self, share: float, exclude: Any = None) -> int:
        """Move ``share`` of the in-flight requests (those not on ``exclude``) to wherever the
        balancer routes now — e.g. a replica just put in service: the most recently started
        segments (the least generated) are aborted on their replicas with their sticky
        assignment dropped, and each resumes from the tokens it has (partial rollout) on the
        least loaded replica. Returns how many were moved."""
        cands = [c for c in self._current.values() if c[0] is not exclude]
        n = int(round(len(cands) * share))
        for replica, seg_id, key in cands[len(cands) - n :]:
            self.balancer.forget(key)
            replica.abort(seg_id)
        return n

    async def _generate(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: str,
        trajectory_id: str | None,
    ) -> TokenOutput:
        tokens: list[int] = []
        logps: list[float] = []
        versions: list[tuple[int, int]] = []
        lb = self.balancer
        try:
            for seg in range(self.max_segments):
                if request_id in self._cancelled:  # aborted for good before it (re)started: a
                    # server's stream can deliver the abort ahead of the generate it targets
                    return TokenOutput(tokens, logps, "abort", None, versions)
                key = trajectory_id if trajectory_id is not None else request_id
                try:
                    idx = lb.pick(key)
                except ReplicaDeadError as e:  # none is left: wait for a restart, if one comes
                    await _await_restart(lb, e)
                    continue
                replica = lb.replicas[idx]
                sp = (  # the first segment runs the caller's sampling as it is
                    sampling
                    if seg == 0 and not tokens
                    else sampling.evolve(
                        max_new_tokens=sampling.max_new_tokens - len(tokens),
                        seed=_segment_seed(sampling.seed, seg),
                        continued=sampling.continued + len(tokens),
                    )
                )
                seg_id = request_id if seg == 0 else f"{request_id}#resume{seg}"
                self._current[request_id] = (replica, seg_id, key)
                lb.acquire(idx)
                try:
                    out = await replica.generate(prompt + tokens, sp, seg_id)
                except asyncio.CancelledError:  # the caller dropped it: free the engine's slot
                    replica.abort(seg_id)
                    raise
                except ReplicaDeadError as e:  # its replica died: the segment starts again
                    if e.replica_id < 0 or request_id in self._cancelled:
                        raise
                    self.reissued += 1
                    logger.info(
                        "request %s: replica %d died (%s); re-issuing after %d tokens",
                        request_id,
                        idx,
                        e.reason,
                        len(tokens),
                    )
                    continue
                finally:
                    lb.release(idx)
                tokens += out.token_ids
                logps += out.log_probs
                versions += out.versions or [(len(out.token_ids), replica.policy_version)]
                done = out.finish_reason != "abort" or request_id in self._cancelled
                if done or len(tokens) >= sampling.max_new_tokens:
                    reason = (
                        out.finish_reason
                        if out.finish_reason != "abort" or request_id in self._cancelled
                        else "length"
                    )
                    return TokenOutput(tokens, logps, reason, out.stop_reason, versions)
                logger.debug(
                    "request %s interrupted after %d tokens; resuming (segment %d)",
                    request_id,
                    len(tokens),
                    seg + 1,
                )
            raise RolloutError(
                f"request {request_id!r} was interrupted {self.max_segments} times; "
                f"raise max_segments or pause replicas less often"
            )
        finally:
            self._current.pop(request_id, None)
            self._cancelled.discard(request_id)
