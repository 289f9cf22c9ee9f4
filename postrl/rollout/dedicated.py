"""The dedicated rollout replicas of a run: every replica in a process (or Ray actor) of its
own, and how to start one more in a slot (a restart).

A run gets them where its mode declares ``dedicated_rollout`` (``fully_async``), its data plane
declares ``rollout_side`` (``object_store``, in every mode) or its backend declares
``own_process`` (``vllm``, in every mode); the trainer decides that from its registries and
describes the replicas in a :class:`DedicatedSpec` (``postrl.trainer.context``), so this module
reads no config and names no mode.

Without a :class:`ReplicaPlacement`: ``num_replicas`` local processes
(:func:`~postrl.rollout.replica_process.spawn_replica`) with ``threads`` torch threads each,
logs in ``RUN_DIR/rollout_replica_<i>.log``. With one (``trainer.backend=ray``): Ray actors
(:class:`~postrl.rollout.ray_replica.RayRolloutReplica`), each on its slot's bundle of a
placement group the caller reserved apart from the training workers' pool (one bundle per
replica of ``threads`` CPUs, plus one GPU each with ``use_gpu``); :meth:`DedicatedReplicas.close`
releases it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from postrl.rollout.base import replica_python, runs_in_own_process

__all__ = [
    "DedicatedReplicas",
    "DedicatedSpec",
    "ReplicaPlacement",
    "replica_deadlines",
    "sweep_shared_dirs",
]


@dataclass(frozen=True)
class DedicatedSpec:
    """How every dedicated replica of a run is started (one spec for all slots).

    Attributes:
        backend: the rollout backend's registry name (``rollout.backend``).
        model_path: the policy every replica loads (``model.path``).
        num_replicas: slots (``rollout.num_replicas``).
        options: the backend's constructor options (slots, KV length, device,
            ``rollout.engine_kwargs``; JSON values).
        threads: torch threads per replica (``trainer.async.rollout_threads``).
        nice: added to each replica process's niceness (``trainer.async.rollout_nice``).
        control_timeout_s: deadline of a control call (health, pause, weights).
        request_timeout_s: deadline of one generate request (``trainer.async.timeout_s``).
        run_dir: where each replica writes ``rollout_replica_<slot>.log``.
        python: the interpreter of a replica process (``rollout.python``; "" for the
            backend's default, :func:`~postrl.rollout.base.replica_python`).
        use_gpu: one GPU per Ray replica.
        requested_by: what asked for dedicated replicas, named in errors (e.g.
            ``"trainer.mode=fully_async"``).
        lend_cores: replica processes (not Ray actors) lend their cores while they have no
            request in flight (``trainer.lend_cores``; :mod:`postrl.protocol.cores`): their
            leases are in :attr:`DedicatedReplicas.shared_dir`.
    """

    backend: str
    model_path: str
    num_replicas: int
    options: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    nice: int = 0
    control_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    run_dir: str = "."
    python: str = ""
    use_gpu: bool = False
    requested_by: str = "dedicated rollout replicas"
    lend_cores: bool = False


@dataclass
class ReplicaPlacement:
    """Where each slot's Ray actor runs: ``strategies[slot]`` (a scheduling strategy on the
    slot's bundle of a placement group the caller reserved) and ``release()``, which gives the
    group back (called once, by :meth:`DedicatedReplicas.close`)."""

    strategies: list[Any]
    release: Callable[[], None]


def replica_deadlines(spec: DedicatedSpec) -> tuple[float, float]:
    """(control, start-up) deadlines of one dedicated replica: a backend that declares
    ``own_process`` (an engine of a venv of its own, e.g. vllm) starts and reloads slowly."""
    if runs_in_own_process(spec.backend):
        return max(spec.control_timeout_s, 300.0), max(spec.request_timeout_s, 900.0)
    return spec.control_timeout_s, max(spec.request_timeout_s, 120.0)


_SHARED_PREFIX = "postrl-shared-"


def sweep_shared_dirs(parent: str) -> int:
    """Remove the shared directories (``postrl-shared-<pid>-*``: weight buffers, core leases)
    that runs whose process is gone left in ``parent`` — a SIGKILLed trainer never reaches
    :meth:`DedicatedReplicas.close`, and its reserved weight buffer would hold tmpfs memory.
    Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        pid = name[len(_SHARED_PREFIX) :].split("-", 1)[0]
        if not name.startswith(_SHARED_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed += 1
    return removed


class DedicatedReplicas:
    """Starts the replicas of a :class:`DedicatedSpec` (module docstring) and one more in a
    slot on demand (:meth:`spawn`: the fleet's restart of a dead replica).

    Args:
        spec: how every replica is started.
        placement: the reserved Ray placement (Ray actors); None: local processes.
        actor_body: the Ray actor class (default
            :class:`~postrl.rollout.ray_replica.ReplicaActor`; a subclass adds methods, e.g. the
            trainer's rollout-side trajectories).
        prepare: ``prepare(replica)`` after each Ray replica answers (e.g. set up its agent
            loops and reward); a failure kills that replica and is raised.
        on_close: called by :meth:`close` before the placement is released (e.g. the caller's
            actors that live as long as the replicas).
    """

    def __init__(
        self,
        spec: DedicatedSpec,
        *,
        placement: ReplicaPlacement | None = None,
        actor_body: type | None = None,
        prepare: Callable[[Any], None] | None = None,
        on_close: tuple[Callable[[], None], ...] = (),
    ) -> None:
        if placement is not None and len(placement.strategies) < spec.num_replicas:
            raise ValueError(
                f"placement has {len(placement.strategies)} bundles for "
                f"{spec.num_replicas} replicas; reserve one bundle per replica"
            )
        self.spec = spec
        self.placement = placement
        self.actor_body = actor_body
        self.prepare = prepare
        self._on_close = on_close
        self.shared_dir: str | None = None
        """A directory the trainer shares with its replica processes (None with Ray actors):
        weight buffers they map (:class:`~postrl.weights.buckets.SharedWeightBuffer`) and, with
        ``lend_cores``, their core leases (owner ``replica-<slot>``, :meth:`core_owners`).
        On a tmpfs (``/dev/shm``) where there is one, named after this process's pid; removed by
        :meth:`close`, or by the next run's :func:`sweep_shared_dirs` when this one was
        killed."""
        if placement is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
            sweep_shared_dirs(shm)
            self.shared_dir = tempfile.mkdtemp(prefix=f"{_SHARED_PREFIX}{os.getpid()}-", dir=shm)

    def start(self) -> list[Any]:
        """Start every replica (all or none: a failure closes those already started, and
        :meth:`close` runs)."""
        replicas: list[Any] = []
        try:
            for i in range(self.spec.num_replicas):
                replicas.append(self.spawn(i))
        except BaseException:
            for rep in replicas:
                rep.close()
            self.close()
            raise
        return replicas

    def spawn(self, slot: int) -> Any:
        """Start the replica for ``slot`` (the first time, or in place of a dead one: a Ray
        actor reuses the slot's bundle)."""
        if self.placement is not None:
            return self._spawn_actor(slot)
        return self._spawn_process(slot)

    def core_owners(self) -> dict[str, int]:
        """``{owner name: threads}`` of every slot's core lease ({} when none lends), what a
        :class:`~postrl.protocol.cores.CoreBorrower` is built from."""
        if self.shared_dir is None or not self.spec.lend_cores:
            return {}
        return {f"replica-{i}": self.spec.threads for i in range(self.spec.num_replicas)}

    def _log(self, slot: int) -> Path:
        log = Path(self.spec.run_dir) / f"rollout_replica_{slot}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        return log

    def _spawn_actor(self, slot: int) -> Any:
        from postrl.rollout.ray_replica import RayRolloutReplica

        spec = self.spec
        assert self.placement is not None
        control_s, startup_s = replica_deadlines(spec)
        log = self._log(slot)
        rep = RayRolloutReplica.create(
            spec.backend,
            spec.model_path,
            slot,
            num_cpus=float(spec.threads),
            num_gpus=1.0 if spec.use_gpu else 0.0,
            threads=spec.threads,
            nice=spec.nice,
            actor_options={"scheduling_strategy": self.placement.strategies[slot]},
            timeout_s=control_s,
            request_timeout_s=spec.request_timeout_s,
            startup_timeout_s=startup_s,
            body=self.actor_body,
            process={  # used where the backend declares own_process (e.g. vllm)
                "python": spec.python,
                "log_path": str(log),
                "startup_timeout_s": startup_s,
                "control_timeout_s": control_s,
                "request_timeout_s": spec.request_timeout_s,
            },
            **spec.options,
        )
        if self.prepare is not None:
            try:
                self.prepare(rep)
            except BaseException:
                rep.kill()
                raise
        return rep

    def _spawn_process(self, slot: int) -> Any:
        """One replica process (``postrl.rollout.replica_process``) for ``slot``."""
        spec = self.spec
        try:
            import fastapi  # noqa: F401
            import httpx  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"{spec.requested_by} serves its rollout replicas over HTTP and needs "
                f"fastapi, uvicorn and httpx ({e}); pip install 'postrl[serve]'"
            ) from e
        from postrl.rollout.replica_process import spawn_replica

        own = runs_in_own_process(spec.backend)  # an engine of its own venv starts slowly
        control_s, startup_s = replica_deadlines(spec)
        return spawn_replica(
            spec.model_path,
            backend=spec.backend,
            options=spec.options,
            threads=spec.threads,
            nice=spec.nice,
            replica_id=slot,
            log_path=self._log(slot),
            request_timeout_s=spec.request_timeout_s,
            control_timeout_s=control_s,
            startup_timeout_s=startup_s if own else 120.0,
            python=replica_python(spec.backend, spec.python),
            shared_dir=self.shared_dir,
            core_lease=f"replica-{slot}" if self.spec.lend_cores else "",
        )

    def close(self) -> None:
        """Run ``on_close`` and release the placement (the replicas themselves close with the
        fleet). Idempotent."""
        on_close, self._on_close = self._on_close, ()
        for fn in on_close:
            fn()
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.release()
        shared, self.shared_dir = self.shared_dir, None
        if shared is not None:
            shutil.rmtree(shared, ignore_errors=True)
