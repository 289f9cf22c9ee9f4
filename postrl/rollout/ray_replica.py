"""Ray actor variant of ``RolloutReplica`` (the ``ray`` controller backend).

``RayRolloutReplica.create(backend, model_path, **options)`` starts one actor that owns a
backend; the returned handle has the surface of ``RolloutReplica`` (``load``,
``policy_version``, async ``generate``, ``abort``, ``pause``/``resume``, ``update_weights``,
``receive_bucket``, ``sleep``/``wake_up``) plus what an out-of-process replica needs in
``fully_async`` (``dead`` / ``mark_dead`` / ``race`` from
:class:`~postrl.rollout.liveness.Liveness`, async ``health``, ``process_gone``, ``busy_s``,
``last_swap``, ``kill``), so ``LoadBalancer``, ``RolloutClient``, the weight-sync backends and
the :class:`~postrl.rollout.watchdog.ReplicaWatchdog` drive it unchanged.

Placement is the caller's: ``actor_options`` go to ``ActorClass.options`` (a
``PlacementGroupSchedulingStrategy`` puts the replica on a bundle of a placement group of its
own; the trainer layer builds it from a ``ResourcePool``). Weights cross the process boundary
as ``postrl.weights`` bucket frames (raw bytes + JSON header), never as pickled tensors; the
weights are swapped in atomically at an update's last frame while the actor keeps serving (the
native engine's in-flight swap, as in the HTTP replica). A call that finds the actor dead
(``RayActorError``) or that misses its deadline declares the replica dead. Ray is imported only
when this module is used.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable
from typing import Any

from postrl.protocol.traffic import DRIVER_TRAFFIC
from postrl.rollout.liveness import Liveness
from postrl.rollout.types import (
    ReplicaDeadError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

__all__ = ["RayRolloutReplica", "ReplicaActor"]


class ReplicaActor:
    """Body of the Ray actor: ``self.replica`` around a freshly created backend, with
    ``threads`` torch threads. Subclass it to run more in the replica's process (pass the
    subclass as ``RayRolloutReplica.create(body=...)``).

    A backend whose registry entry declares ``own_process`` (its engine needs packages of its
    own venv, e.g. ``vllm``) cannot load in the actor's interpreter: the actor then starts the
    replica process with the entry's interpreter (``base.replica_python``; ``process["python"]``
    overrides it) through the launcher the local path uses (``remote.spawn_replica``), on the
    actor's node and inside its placement, and ``self.replica`` is that process's
    :class:`~postrl.rollout.http_replica.HTTPRolloutReplica` (127.0.0.1). The actor exits when that
    process exits or its handle declares it dead (a ``ReplicaDeadError`` never leaves the
    actor), so the driver's handle sees the actor dead as with an in-actor engine, and
    the process dies with the actor (it watches its parent). ``health`` then reports the
    replica process's pid (the watchdog's CPU-progress check reads it).

    ``process``: settings of such a process: ``python``, ``log_path``, ``startup_timeout_s``,
    ``control_timeout_s``, ``request_timeout_s`` (ignored for an in-actor backend)."""

    def __init__(
        self,
        backend: str,
        model_path: str,
        replica_id: int,
        options: dict,
        threads: int = 0,
        nice: int = 0,
        process: dict[str, Any] | None = None,
    ) -> None:
        from postrl.rollout.base import create_rollout_backend, runs_in_own_process
        from postrl.rollout.client import RolloutReplica

        self._proc_pid: int | None = None
        self._closing = False
        if runs_in_own_process(backend):
            self.replica = self._spawn(
                backend, model_path, replica_id, options, threads, nice, process or {}
            )
            return
        if nice:
            os.nice(nice)
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        self.replica = RolloutReplica(
            create_rollout_backend(backend, model_path, **options), replica_id
        )

    def _spawn(
        self,
        backend: str,
        model_path: str,
        replica_id: int,
        options: dict,
        threads: int,
        nice: int,
        process: dict[str, Any],
    ) -> Any:
        import threading
        import time

        from postrl.rollout.base import replica_python
        from postrl.rollout.replica_process import spawn_replica

        rep = spawn_replica(
            model_path,
            backend=backend,
            options=options,
            threads=max(1, threads),
            nice=nice,
            replica_id=replica_id,
            log_path=process.get("log_path") or None,
            startup_timeout_s=float(process.get("startup_timeout_s", 900.0)),
            request_timeout_s=float(process.get("request_timeout_s", 600.0)),
            control_timeout_s=float(process.get("control_timeout_s", 300.0)),
            python=replica_python(backend, str(process.get("python") or "")),
        )
        self._proc_pid = rep.local_pid

        def watch() -> None:  # the replica process gone (or dead): so is this actor
            while rep.process.poll() is None and not rep.dead:
                time.sleep(0.5)
            self._process_dead()

        threading.Thread(target=watch, daemon=True, name="replica-process-watch").start()
        return rep

    def _process_dead(self) -> None:
        """The replica process is gone or its handle declared it dead: end this actor at once
        (unless closing), so the driver's handle sees ``RayActorError`` and declares the replica
        dead, as with an engine in the actor (the process is killed first)."""
        if self._closing:
            return
        proc = self.replica.process
        if proc is not None and proc.poll() is None:
            proc.kill()
        os._exit(1)

    async def _forward(self, aw: Any) -> Any:
        try:
            return await aw
        except ReplicaDeadError:
            if self._proc_pid is not None:
                self._process_dead()
            raise

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        return await self._forward(self.replica.generate(prompt_ids, sampling, request_id))

    async def call(self, method: str, *args: Any) -> Any:
        if self._proc_pid is not None and method != "abort":  # blocking HTTP: off the loop
            return await self._forward(asyncio.to_thread(getattr(self.replica, method), *args))
        return getattr(self.replica, method)(*args)

    async def receive_bucket(self, frame: bytes) -> dict[str, Any]:
        if self._proc_pid is not None:  # one frame in flight: the driver awaits each answer
            return await self._forward(asyncio.to_thread(self.replica.receive_bucket_report, frame))
        return self.replica.receive_bucket_report(frame)

    async def health(self) -> dict[str, Any]:
        if self._proc_pid is not None:
            if self.replica.process_gone() is not None or self.replica.dead:
                self._process_dead()
            d = await self.replica.health(self.replica.control_timeout_s)
            return {**d, "pid": self._proc_pid, "host": socket.gethostname()}
        return {**self.replica.status(), "pid": os.getpid(), "host": socket.gethostname()}

    async def policy_version(self) -> int:
        return self.replica.policy_version

    async def close(self) -> None:
        """Close the replica (a replica process is terminated, its engine shut down)."""
        self._closing = True
        await asyncio.to_thread(self.replica.close)


class RayRolloutReplica(Liveness):
    """Handle to a replica running in a Ray actor (see module docstring).

    Args:
        actor: the Ray actor handle; use ``create`` to build one.
        replica_id: index in logs and errors.
        timeout_s: deadline of blocking control calls (a replica that misses it is dead).
        request_timeout_s: deadline of one generate request.
    """

    def __init__(
        self,
        actor: Any,
        replica_id: int = 0,
        timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        Liveness.__init__(self)
        self.actor = actor
        self.replica_id = replica_id
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.policy_version = 0
        self.standby = False
        """Out of service without being dead (nothing is routed to it)."""
        self.last_swap: dict[str, float] = {}
        self.busy_s = 0.0
        self.busy_at = 0.0
        """The replica engine's seconds in steps, as of the last health ping."""
        self.pid = 0
        """The actor's process id (from the first health answer)."""
        self.local_pid: int | None = None
        """:attr:`pid` when the actor runs on this machine (the watchdog reads its CPU
        progress), else None."""
        self._inflight = 0
        self._gone: str | None = None

    @classmethod
    def create(
        cls,
        backend: str,
        model_path: str,
        replica_id: int = 0,
        num_cpus: float = 1,
        num_gpus: float = 0,
        *,
        threads: int = 0,
        nice: int = 0,
        actor_options: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        startup_timeout_s: float | None = None,
        body: type | None = None,
        process: dict[str, Any] | None = None,
        **options: Any,
    ) -> RayRolloutReplica:
        """Start the actor (``ray.init`` must have been called) and wait until it answers
        ``health`` (``startup_timeout_s``, default ``timeout_s``; ``RolloutError`` naming the
        replica otherwise). ``threads``: torch threads in the actor (0: Ray's default, one
        per reserved CPU); ``nice``: added to the actor process's niceness;
        ``actor_options``: extra ``.options(...)`` such as a ``scheduling_strategy``;
        ``body``: the actor class (default :class:`ReplicaActor`; a subclass adds methods, e.g.
        the trainer's rollout-side trajectories); ``process``: settings of the replica
        process the actor starts for a backend that declares ``own_process`` (see
        :class:`ReplicaActor`); ``options``: the backend's constructor options."""
        import ray

        from postrl.rollout.types import RolloutError

        actor_cls = ray.remote(body or ReplicaActor).options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_concurrency=1024,
            max_restarts=0,
            max_task_retries=0,
            **(actor_options or {}),
        )
        actor = actor_cls.remote(backend, model_path, replica_id, options, threads, nice, process)
        rep = cls(actor, replica_id, timeout_s=timeout_s, request_timeout_s=request_timeout_s)
        wait = timeout_s if startup_timeout_s is None else startup_timeout_s
        try:
            d = ray.get(actor.health.remote(), timeout=wait)
        except Exception as e:
            ray.kill(actor, no_restart=True)
            raise RolloutError(
                f"rollout replica {replica_id} (Ray actor, backend {backend!r}) did not come up "
                f"within {wait}s: {type(e).__name__}: {e}"
            ) from e
        rep.policy_version, rep.pid = int(d["policy_version"]), int(d["pid"])
        if d.get("host") == socket.gethostname():
            rep.local_pid = rep.pid
        return rep

    @property
    def load(self) -> int:
        """In-flight requests sent through this handle."""
        return self._inflight

    def process_gone(self) -> str | None:
        """Why the actor is gone (Ray reported it dead), or None while it may still run."""
        return self._gone

    def _died(self, e: BaseException) -> ReplicaDeadError:
        self._gone = self._gone or f"Ray actor died ({type(e).__name__}: {str(e)[:300]})"
        self.mark_dead(self._gone)
        return ReplicaDeadError(self.replica_id, self._gone)

    def _get(self, ref: Any, what: str) -> Any:
        """``ray.get`` with the control deadline; a dead or silent actor is declared dead."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self.check_alive()
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayActorError as e:
            raise self._died(e) from e
        except GetTimeoutError as e:  # a hung replica is dead too
            reason = f"{what} got no answer within {self.timeout_s}s"
            self.mark_dead(reason)
            raise ReplicaDeadError(self.replica_id, reason) from e

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Run one request in the actor; :class:`ReplicaDeadError` when it dies meanwhile."""
        self._inflight += 1
        try:
            return await self.race(self._generate(list(prompt_ids), sampling, request_id))
        finally:
            self._inflight -= 1

    async def _generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        from ray.exceptions import RayActorError

        DRIVER_TRAFFIC.count("out", "prompts", (prompt_ids, sampling))
        ref = self.actor.generate.remote(prompt_ids, sampling, request_id)
        try:
            out = await asyncio.wait_for(ref, self.request_timeout_s)
            DRIVER_TRAFFIC.count("in", "rollout.generate", out)
            return out
        except RayActorError as e:
            raise self._died(e) from e
        except asyncio.TimeoutError as e:
            raise RolloutTimeoutError(
                f"replica {self.replica_id}: request {request_id!r} exceeded "
                f"{self.request_timeout_s}s"
            ) from e

    async def health(self, timeout_s: float) -> dict[str, Any]:
        """The actor's health answer within ``timeout_s`` (raises on failure; a dead actor is
        remembered for :meth:`process_gone`)."""
        from ray.exceptions import RayActorError

        try:
            d = await asyncio.wait_for(self.actor.health.remote(), timeout_s)
        except RayActorError as e:
            self._gone = self._gone or f"Ray actor died ({type(e).__name__})"
            raise
        return d

    def abort(self, request_id: str) -> None:
        """Abort one request (fire and forget: its caller gets the partial output)."""
        if not self.dead:
            self.actor.call.remote("abort", request_id)

    def pause(self) -> None:
        """Abort in-flight requests and hold new ones."""
        self._get(self.actor.call.remote("pause"), "pause")

    def resume(self) -> None:
        """Serve again."""
        self._get(self.actor.call.remote("resume"), "resume")

    def update_weights(
        self,
        weights: Iterable[WeightItem],
        version: int | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """Stream weights as bucket frames (raw bytes), one bucket in flight at a time."""
        from postrl.weights import send_frames

        send_frames(weights, self.receive_bucket, version, bucket_bytes)

    def receive_bucket(self, frame: bytes) -> None:
        """Forward one bucket frame to the actor; at an update's last frame the actor swaps the
        weights in (its answer carries the swap's pause and recompute times)."""
        DRIVER_TRAFFIC.count("out", "weights", frame)
        d = self._get(self.actor.receive_bucket.remote(frame), "weights/bucket")
        self.policy_version = int(d["policy_version"])
        if d.get("swap"):
            self.last_swap = {k: float(v) for k, v in d["swap"].items()}

    def sleep(self) -> None:
        """Release the backend's KV cache."""
        self._get(self.actor.call.remote("sleep"), "sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released."""
        self._get(self.actor.call.remote("wake_up", tags), "wake_up")

    def kill(self) -> None:
        """Kill the actor (a dead or hung one, before a restart); its resources return to its
        placement-group bundle."""
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone, or Ray shut down)
            pass

    def close(self) -> None:
        """Close the replica in the actor (its engine, or the replica process it started, shuts
        down; at most ``min(timeout_s, 30)`` s), then kill the actor."""
        import ray

        if not self.dead:
            try:
                ray.get(self.actor.close.remote(), timeout=min(self.timeout_s, 30.0))
            except Exception:  # noqa: BLE001 (dead or hung: the kill below ends it)
                pass
        self.kill()
