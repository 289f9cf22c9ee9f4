"""``TrainerContext``: the narrow view of a run that trainer modes and validation are built from.

A mode (``postrl.trainer.modes``) decides where a step's batch comes from and when weights move;
validation generates and scores held-out prompts. Both need the same few things — the config,
the prompt loader, the agent-loop manager on the rollout fleet, the reward stage, and the actor
as the source of weights — and nothing else of the trainer. :func:`build_context` makes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from postrl.config import PostRLConfig
from postrl.data import PromptLoader
from postrl.protocol import DataProto
from postrl.reward.stage import build_reward_stage  # the reward stage's builder, in reward/
from postrl.rollout.loop_thread import LoopThread
from postrl.rollout.signal import Signal

if TYPE_CHECKING:  # annotations only: these layers are imported lazily where they are built
    from transformers import PreTrainedTokenizerBase

    from postrl.agent import AgentLoopManager
    from postrl.controller.worker_group import WorkerGroup
    from postrl.reward.stage import RewardStage
    from postrl.rollout import Replica
    from postrl.rollout.dedicated import DedicatedReplicas
    from postrl.rollout.fleet import RolloutFleet

logger = logging.getLogger(__name__)

__all__ = ["TrainerContext", "build_context", "build_reward_stage", "kv_capacity"]


def single_threaded_torch() -> None:
    """Run this thread's torch ops on one thread (for the trainer's helper threads). Each
    thread that runs a parallel torch op gets an OpenMP team of its own; with the event-loop
    thread's and the executor threads' teams next to the trainer's, OpenMP has more threads
    than cores and stops spinning between parallel regions, so the trainer's team sleeps and
    wakes on every op: measured on W1 in ``fully_async`` (2 cores), the update took 0.23 s
    instead of 0.12 s."""
    import torch

    torch.set_num_threads(1)


def _new_loop_thread() -> LoopThread:
    """The context's event loop, inline until a mode starts its thread; the thread and the
    loop's default executor (reward scoring, ``asyncio.to_thread`` tool calls) run torch
    single-threaded (:func:`single_threaded_torch`)."""
    return LoopThread(
        "postrl-trainer-loop",
        start=False,
        thread_init=single_threaded_torch,
        executor_name="postrl-trainer-exec",
    )


@dataclass
class TrainerContext:
    """What modes and validation may use.

    Attributes:
        cfg: the validated config (read only).
        tokenizer: the policy tokenizer.
        loader: the training prompt loader (seeded order, exact resume).
        agents: the ``AgentLoopManager`` running agent loops on the fleet's replicas.
        fleet: the ``RolloutFleet`` (wake/sleep, weights, policy version).
        reward: the ``RewardStage`` (streaming hook + ``finish``).
        actor: the actor worker group, the source of weights.
        remote_actor: the actor lives in other processes (Ray): weights arrive as frames.
        total_steps: the run's RL steps (0 = unknown); async modes admit no more prompts than
            the run will train.
    """

    cfg: PostRLConfig
    tokenizer: PreTrainedTokenizerBase
    loader: PromptLoader
    agents: AgentLoopManager
    fleet: RolloutFleet
    reward: RewardStage
    actor: WorkerGroup
    remote_actor: bool = False
    total_steps: int = 0
    replica_spawner: Callable[[int], Replica] | None = None
    """``spawn(slot) -> replica``: start a rollout replica in a slot of the fleet (dedicated
    modes: a restart of a dead one); None where replicas live in this process."""
    runner: Any = None
    """The data plane's :class:`~postrl.trainer.runner.TrajectoryRunner`: how a row becomes a
    trajectory, a group is scored and taken groups a batch (a
    :class:`~postrl.trainer.runner.LocalRunner`, or with ``trainer.async.data_plane=
    object_store`` an :class:`~postrl.trainer.object_store.ObjectStoreRunner`); chosen once,
    by :func:`build_context`."""
    rollout_options: dict[str, Any] = field(default_factory=dict)
    """The options every rollout backend of the run was created with (slots, KV length,
    device, ``rollout.engine_kwargs``): an in-process replica made later (the idle switch)
    gets the same."""
    core_lease: tuple[str, dict[str, int]] | None = None
    """``(directory, {owner: threads})`` when the rollout replica processes lend their cores
    while idle (``trainer.lend_cores``): the trainer hands it to its training workers."""
    loop_thread: LoopThread = field(default_factory=_new_loop_thread, repr=False)
    """The context's event loop (:class:`~postrl.rollout.loop_thread.LoopThread`): agent loops,
    tool calls, reward scoring and HTTP traffic to the rollout replicas run on it."""

    def start_background(self) -> None:
        """Run the context's event loop in a thread of its own from now on (``fully_async``:
        agent loops, tool calls, reward scoring and HTTP traffic to the rollout replicas go on
        while the main thread trains). :meth:`run_async` then submits to that thread and blocks;
        :meth:`create_task` may only be called from it."""
        self.loop_thread.start()

    @property
    def in_background(self) -> bool:
        """Whether the loop runs in its own thread (:meth:`start_background`)."""
        return self.loop_thread.started

    def sampling_params(self, validation: bool = False) -> Any:
        """Rollout sampling parameters (validation uses ``rollout.val_kwargs``)."""
        from postrl.rollout import SamplingParams

        r = self.cfg.rollout
        stop_ids = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        if validation:
            v = r.val_kwargs
            return SamplingParams(
                temperature=v.temperature,
                top_p=v.top_p,
                max_new_tokens=r.response_length,
                stop_token_ids=stop_ids,
            )
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.response_length,
            stop_token_ids=stop_ids,
        )

    def run_async(
        self, coro: Any, wake: Signal | None = None, on_wake: Callable[[], None] | None = None
    ) -> Any:
        """Run a coroutine on the context's persistent event loop (in the loop's thread after
        :meth:`start_background`) and return its result. With a background loop, ``on_wake``
        runs on this thread at each notification of ``wake`` (a
        :class:`~postrl.rollout.signal.Signal`) while it waits (:meth:`LoopThread.run_sync`)."""
        return self.loop_thread.run_sync(coro, wake, on_wake)

    def submit_async(self, coro: Any) -> Any:
        """Schedule a coroutine on the context's loop without waiting for it; returns its
        ``concurrent.futures.Future`` (:meth:`LoopThread.submit`)."""
        return self.loop_thread.submit(coro)

    def create_task(self, coro: Any) -> asyncio.Task[Any]:
        """Schedule a coroutine on the context's loop (it runs whenever the loop next runs:
        during :meth:`run_async`, e.g. a mode's take or a validation; at once when the loop runs
        in the background, where this must be called from the loop's thread)."""
        return self.loop_thread.create_task(coro)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` closed the event loop."""
        return self.loop_thread.closed

    def generate(
        self,
        prompts: DataProto,
        sampling: Any,
        n: int,
        step: int,
        on_trajectory: Callable[..., None] | None = None,
    ) -> DataProto:
        """``n`` trajectories per prompt on the fleet (woken for it, put to sleep after when
        ``rollout.free_cache_engine``; a fleet an async mode paused serves for the call and is
        paused again after); ``on_trajectory(i, output, row)`` per finished one."""
        self.fleet.wake_up()
        paused = self.fleet.paused
        if paused:
            self.fleet.resume()
        try:
            return self.run_async(
                self.agents.generate(
                    prompts,
                    sampling,
                    n,
                    seed=self.cfg.trainer.seed,
                    step=step,
                    on_sample_end=on_trajectory,
                )
            )
        finally:
            if paused:
                self.fleet.pause()
            if self.cfg.rollout.free_cache_engine and not self.in_background:
                self.fleet.sleep()  # (dedicated replicas keep generating for training)

    def prompts_of(self, batch: DataProto) -> DataProto:
        """The prompt rows a batch was generated from (one per uid, first-seen order)."""
        nt = batch.non_tensor_batch
        seen: dict[Any, int] = {}
        for uid, index in zip(nt["uid"], nt["index"]):
            seen.setdefault(uid, int(index))
        return self.loader.dataset.batch(list(seen.values()))

    def weight_source(self) -> Any:
        """``open_source(version)`` for the fleet: the actor's current weights as a per-tensor
        stream (in-process actor) or as bucket frames pulled from its workers (Ray)."""
        from postrl.weights import FrameStream

        bucket = int(self.cfg.rollout.weight_bucket_mb * (1 << 20))
        if self.remote_actor:
            return lambda v: FrameStream.from_actor(self.actor, bucket, v)
        return lambda v: self.actor.get_per_tensor_param()

    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's weights into every replica and verify them (the weight-sync
        contract, ``trainer/weight_check.py``); ``weights/*`` and ``weight_sync/*`` metrics."""
        from postrl.trainer.weight_check import contract_for

        return contract_for(self).sync(self.weight_source())

    def close(self) -> None:
        """Close the agent loops (the gateway's server), the fleet, the reward stage and the
        event loop."""
        if not self.loop_thread.closed and self.loop_thread.alive:
            close = getattr(self.agents, "aclose", None)
            if close is not None:
                try:
                    self.run_async(close())
                except Exception as e:  # closing must go on: the fleet and reward still close
                    logger.warning("closing the agent loops failed: %r", e)
        self.fleet.close()
        self.reward.close()
        self.loop_thread.close(join_timeout_s=30)


def kv_capacity(cfg: PostRLConfig, multi_turn: bool) -> int:
    """Tokens per KV slot: prompt + response, plus the agent-turn allowances only for multi-turn
    loops (an oversized cache costs real memory traffic on every wake-up)."""
    r = cfg.rollout
    if r.max_model_len:
        return r.max_model_len
    if not multi_turn:
        return cfg.data.max_prompt_length + r.response_length
    a = r.agent
    return (
        cfg.data.max_prompt_length
        + r.response_length * max(1, a.max_assistant_turns)
        + a.max_tool_response_length * a.max_user_turns
    )


def build_context(
    cfg: PostRLConfig,
    tokenizer: Any,
    loader: PromptLoader,
    actor: Any,
    reward_model: Any = None,
    *,
    multi_turn: bool = True,
) -> TrainerContext:
    """Create the rollout replicas and fleet, the agent-loop manager and the reward stage."""
    import inspect

    from postrl.agent import AgentLoopManager
    from postrl.rollout import LoadBalancer, RolloutClient, RolloutReplica, create_rollout_backend
    from postrl.rollout.base import runs_in_own_process
    from postrl.rollout.fleet import RolloutFleet
    from postrl.weights import WEIGHT_SYNC_BACKENDS

    r, tc = cfg.rollout, cfg.trainer
    max_len = kv_capacity(cfg, multi_turn)
    options: dict[str, Any] = dict(
        max_num_seqs=r.max_num_seqs, max_model_len=max_len, device=tc.device
    )
    options.update(r.engine_kwargs)
    from postrl.trainer.modes import TRAINER_MODES
    from postrl.trainer.planes import DATA_PLANES

    plane = DATA_PLANES.meta(tc.async_.data_plane)  # (its runner: how trajectories travel)
    rollout_side = bool(plane.get("rollout_side"))  # trajectories run on replica actors
    dedicated = bool(TRAINER_MODES.meta(tc.mode).get("dedicated_rollout")) or rollout_side
    own = runs_in_own_process(r.backend)  # e.g. vllm: its own venv, in every mode
    pool: DedicatedReplicas | None = None
    owner: Any = None  # the object-store plane's PayloadOwner actor
    if dedicated or own:  # fully_async: every replica in a process (or Ray actor) of its own
        pool, owner = _dedicated_replicas(cfg, options, payload_owner=rollout_side)
        replicas = pool.start()
    else:
        replicas = [
            RolloutReplica(
                create_rollout_backend(r.backend, cfg.model.path, **options), replica_id=i
            )
            for i in range(r.num_replicas)
        ]
    sync_cls = WEIGHT_SYNC_BACKENDS.get(r.weight_sync)
    params = inspect.signature(sync_cls).parameters
    kw: dict[str, Any] = {}
    if "bucket_bytes" in params:
        kw["bucket_bytes"] = int(r.weight_bucket_mb * (1 << 20))
    if (dedicated or own) and "transport" in params:  # frames as they are: one swap per push
        kw["transport"] = _send_frame
    sync = sync_cls(**kw)
    balancer = LoadBalancer(replicas)
    client = RolloutClient(balancer)
    agents = AgentLoopManager(client, tokenizer, r.agent, max_model_len=max_len)
    reward = build_reward_stage(cfg, tokenizer, reward_model)
    fleet = RolloutFleet(
        replicas, sync, balancer=balancer, on_close=(pool.close,) if pool is not None else ()
    )
    runner = DATA_PLANES.get(tc.async_.data_plane).create(
        agents=agents, reward=reward, fleet=fleet, owner=owner, cfg=cfg
    )
    return TrainerContext(
        cfg,
        tokenizer,
        loader,
        agents,
        fleet,
        reward,
        actor,
        remote_actor=tc.backend == "ray",
        replica_spawner=pool.spawn if pool is not None else None,
        runner=runner,
        rollout_options=options,
        core_lease=(pool.shared_dir, pool.core_owners())
        if pool is not None and pool.shared_dir and pool.core_owners()
        else None,
    )


def _send_frame(bucket: Any, receiver: Any) -> None:
    from postrl.weights import encode_frame

    receiver.receive_bucket(encode_frame(bucket))


def lends_cores(cfg: PostRLConfig) -> bool:
    """Whether the trainer borrows its replica processes' cores while they idle
    (``trainer.lend_cores``): replica processes on this machine (``trainer.backend=local``), CPU
    training, and a split that leaves the replicas' threads to them — ``trainer.num_threads``
    plus every replica's ``rollout_threads`` within this process's cores; a trainer that already
    runs on every core (``num_threads`` 0 or all of them) borrowing more would oversubscribe."""
    tc = cfg.trainer
    if not (tc.lend_cores and tc.device == "cpu" and tc.backend != "ray" and tc.num_threads > 0):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lent = cfg.rollout.num_replicas * tc.async_.rollout_threads
    return tc.num_threads + lent <= (cores or 1)


def _dedicated_replicas(
    cfg: PostRLConfig, options: dict[str, Any], *, payload_owner: bool
) -> tuple[DedicatedReplicas, Any]:
    """The run's :class:`~postrl.rollout.dedicated.DedicatedReplicas` (described from the
    config) and its payload owner (None without one). ``trainer.backend=ray``: a placement
    group of their own (``rollout_replicas``: one bundle per replica of ``rollout_threads``
    CPUs, plus one GPU each with ``trainer.device=cuda``), apart from the training workers'
    pool; with ``payload_owner`` (a data plane that declares ``rollout_side``) also a
    :class:`~postrl.trainer.object_store.PayloadOwner` actor and replicas that run whole
    trajectories (:class:`~postrl.trainer.object_store.TrajectoryReplicaActor`, set up from the
    run's config)."""
    from postrl.rollout.dedicated import DedicatedReplicas, DedicatedSpec

    r, tc, ac = cfg.rollout, cfg.trainer, cfg.trainer.async_
    spec = DedicatedSpec(
        backend=r.backend,
        model_path=cfg.model.path,
        num_replicas=r.num_replicas,
        options=options,
        threads=ac.rollout_threads,
        nice=ac.rollout_nice,
        control_timeout_s=max(ac.replica_health_timeout_s, 30.0),
        request_timeout_s=ac.timeout_s,
        run_dir=tc.run_dir,
        python=r.python,
        use_gpu=tc.device == "cuda",
        requested_by=f"trainer.mode={tc.mode}",
        lend_cores=lends_cores(cfg),
    )
    if tc.backend != "ray":
        return DedicatedReplicas(spec), None
    import ray

    from postrl.controller import ResourcePool
    from postrl.controller.backends.ray import placement_strategies, release_resource_pool
    from postrl.rollout.dedicated import ReplicaPlacement

    if not ray.is_initialized():
        ray.init()
    res = ResourcePool(
        process_on_nodes=(r.num_replicas,),
        use_gpu=spec.use_gpu,
        num_cpus_per_process=float(ac.rollout_threads),
        num_gpus_per_process=1.0,
        name=f"rollout_replicas_{id(spec)}",
        strategy="PACK",  # replicas may spread over nodes
    )
    placement = ReplicaPlacement(
        placement_strategies(res, timeout_s=ac.timeout_s), lambda: release_resource_pool(res)
    )
    if not payload_owner:
        return DedicatedReplicas(spec, placement=placement), None
    from postrl.trainer.object_store import PayloadOwner, TrajectoryReplicaActor

    owner_cls = ray.remote(PayloadOwner).options(num_cpus=0, max_restarts=0, max_concurrency=64)
    owner = owner_cls.remote()
    try:
        ray.get(owner.ping.remote(), timeout=ac.timeout_s)
    except BaseException:
        ray.kill(owner, no_restart=True)
        placement.release()
        raise

    def prepare(rep: Any) -> None:  # its agent loops and reward, from the run's config
        ray.get(
            rep.actor.setup_trajectories.remote(cfg, options["max_model_len"]),
            timeout=max(ac.timeout_s, 120.0),
        )

    pool = DedicatedReplicas(
        spec,
        placement=placement,
        actor_body=TrajectoryReplicaActor,
        prepare=prepare,
        on_close=(lambda: ray.kill(owner, no_restart=True),),
    )
    return pool, owner
