"""``trainer.mode=fully_async``: rollout replicas in processes of their own generate while the
trainer trains one mini-batch per step; weights pushed every ``parameter_sync_step`` steps
without aborting requests; nothing lost or duplicated across replica deaths and whole-run
kills; config errors name the field and the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from trainer_helpers import (
    await_replacement,
    each_prompt_once_per_epoch,
    fully_async_overrides,
    metric_rows,
    train_subprocess,
)

from postrl.config import ConfigError, load_config, validate_config
from postrl.rollout import ReplicaDeadError
from postrl.trainer import RLTrainer, hooks

pytest.importorskip("uvicorn")


def _base(tiny_model_dir, epoch_files, digits_reward, run, steps: int = 16) -> list[str]:
    train, test = epoch_files
    return fully_async_overrides(tiny_model_dir, train, test, digits_reward, run, steps)


FAST_HEALTH = ["trainer.async.replica_health_interval_s=0.5"]
"""Pings every 0.5 s. A killed replica is dead at once (its process exited); silence never
decides in these runs (the default timeout, and a silent replica that works is spared), so a
loaded machine cannot declare a live replica dead."""


def _each_prompt_once_per_epoch(run, epochs: int = 2, size: int = 16) -> None:
    each_prompt_once_per_epoch(run, epochs, size, steps_per_epoch=8)


def test_fully_async_trains_each_prompt_once_within_the_staleness_bound(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    cfg = load_config(None, _base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"))
    trainer = RLTrainer(cfg)
    assert trainer.total_steps == 16
    seen = []
    update = trainer.roles.update_actor

    def spy(batch):
        v = batch.batch["rollout_policy_version"]
        mask = batch.batch["response_mask"].bool()
        seen.append((trainer.ctx.fleet.version, v[mask].min().item(), len(batch)))
        return update(batch)

    trainer.roles.update_actor = spy
    pids = [r.process.pid for r in trainer.ctx.fleet.replicas]
    try:
        trainer.fit()
    finally:
        trainer.close()
    for pid in pids:  # the replica processes are gone with the trainer
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    _each_prompt_once_per_epoch(tmp_path / "run")
    rows = metric_rows(tmp_path / "run")
    assert all(n == 2 * 4 for *_, n in seen), "a step trains one mini-batch of 2 groups × 4"
    for current, oldest, _ in seen:
        assert current - oldest <= 1, "a token older than trainer.async.max_staleness was trained"
    versions = [r["weights/version"] for r in rows if "weights/version" in r]
    assert len(versions) == 8, "weights are pushed every parameter_sync_step=2 steps"
    assert max(r["replay/staleness/max"] for r in rows) <= 1
    assert all(r["rollout/live_replicas"] == 1 for r in rows)
    # nothing is generated that the run will not train: 16 steps x 2 groups admitted, no more
    # (the admit after a take counts that take as trained first), none left over at the end
    assert sum(r["async/admitted_groups"] for r in rows) == 16 * 2
    assert not trainer.mode.feed.buffer.groups()


def test_an_admission_that_fails_after_a_push_fails_the_next_step(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """The admission a push makes room for runs on the loop while the trainer goes on: its
    error is raised by the next step's take, not lost (and the run closes cleanly)."""
    cfg = load_config(None, _base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run", 6))
    trainer = RLTrainer(cfg)
    after, calls = trainer.mode._after_sync, []

    async def failing(step, version):
        calls.append(step)
        if len(calls) == 2:  # the push after the run's first update
            raise RuntimeError("admission failed on purpose")
        await after(step, version)

    trainer.mode._after_sync = failing
    try:
        with pytest.raises(RuntimeError, match="admission failed on purpose"):
            trainer.fit()
    finally:
        trainer.close()
    assert calls == [0, 2]  # the first push, then the one after step 2 (parameter_sync_step=2)
    assert trainer.global_step == 3  # step 3's take raised it


def test_fully_async_config_errors_name_the_field_and_the_fix(small_overrides):
    base = [*small_overrides, "trainer.mode=fully_async"]
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*base, "trainer.async.parameter_sync_step=3"]))
    msg = str(e.value)
    assert "data.train_batch_size=4 with trainer.mode=fully_async" in msg
    assert "parameter_sync_step × actor.ppo_mini_batch_size = 6" in msg
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [*base, "trainer.async.parameter_sync_step=2", "trainer.async.max_staleness=0"],
            )
        )
    assert "set trainer.async.max_staleness >= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None, [*base, "trainer.async.parameter_sync_step=2", "trainer.deterministic=true"]
            )
        )
    assert "trainer.deterministic=true with trainer.mode=fully_async" in str(e.value)
    bad = ["trainer.async.rollout_nice=25", "trainer.async.max_replica_restarts=-1"]
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*base, "trainer.async.parameter_sync_step=2", *bad]))
    assert "trainer.async.rollout_nice=25 must be in 0..19" in str(e.value)
    assert "trainer.async.max_replica_restarts=-1 must be >= 0" in str(e.value)


def test_object_store_data_plane_config_errors_name_the_field_and_the_fix(small_overrides):
    base = [*small_overrides, "trainer.mode=fully_async", "trainer.async.parameter_sync_step=2"]
    plane = "trainer.async.data_plane=object_store"
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*base, plane]))  # the local backend
    assert f"trainer.backend=local with {plane}" in str(e.value)
    assert "set trainer.backend=ray (or set trainer.async.data_plane=driver)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        RLTrainer(load_config(None, [*base, "trainer.async.data_plane=disk"]))
    assert "trainer.async.data_plane='disk': unknown data plane 'disk'" in str(e.value)
    assert "driver, object_store" in str(e.value)
    # every mode is checked (sync used to train on the driver plane without a word): a mode
    # that does not declare object_store is refused by name
    from postrl.trainer import SyncMode, register_trainer

    register_trainer("no_object_store_test", on_policy=True, override=True)(SyncMode)
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [
                    *small_overrides,
                    "trainer.backend=ray",
                    "trainer.mode=no_object_store_test",
                    plane,
                ],
            )
        )
    assert "trainer.mode=no_object_store_test (modes that declare object_store: " in str(e.value)
    for mode in ("sync", "one_step_off"):  # they declare it
        validate_config(
            load_config(
                None, [*small_overrides, "trainer.backend=ray", f"trainer.mode={mode}", plane]
            ),
            check_files=False,
        )
    # carried by fetching the taken groups to the driver (no error): token-level estimators,
    # a critic, KL in the reward, rejection sampling, a KL loss
    carried = [
        "trainer.backend=ray",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.use_kl_in_reward=true",
        "actor.use_kl_loss=true",
        "algorithm.rollout_correction.rollout_rs=sequence",
    ]
    validate_config(load_config(None, [*base, plane, *carried]), check_files=False)
    with pytest.raises(ConfigError) as e:  # the replicas' reward stage has no reward model
        RLTrainer(load_config(None, [*base, plane, *carried, "reward.model.enable=true"]))
    msg = str(e.value)
    assert "reward.model.enable=true with " + plane in msg
    assert "or set trainer.async.data_plane=driver" in msg
    assert "use_kl" not in msg and "rollout_rs" not in msg and "reinforce" not in msg
    assert "trainer.backend=" not in msg and "trainer.mode=" not in msg


def test_separate_async_is_an_alias(small_overrides):
    from postrl.trainer import TRAINER_MODES

    assert TRAINER_MODES.get("separate_async") is TRAINER_MODES.get("fully_async")
    with pytest.raises(ConfigError) as e:  # validated the same way
        RLTrainer(
            load_config(
                None,
                [
                    *small_overrides,
                    "trainer.mode=separate_async",
                    "trainer.async.parameter_sync_step=3",
                ],
            )
        )
    assert "trainer.mode=separate_async" in str(e.value)


def _replica_pids(model_dir) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"postrl.rollout.replica_process --model {model_dir}"],
        capture_output=True,
        text=True,
    ).stdout
    return [int(p) for p in out.split()]


def _fit_with_faults(trainer, faults: dict[str, object]) -> None:
    """Fit with ``faults[point](trainer)`` run at the named fault points."""

    def hook(point: str) -> None:
        if point in faults:
            faults[point](trainer)

    hooks.install(hook)
    try:
        trainer.fit()
    finally:
        hooks.uninstall(hook)


def _record_deaths(trainer) -> dict[int, float]:
    died: dict[int, float] = {}
    for r in trainer.ctx.fleet.replicas:
        mark = r.mark_dead

        def marked(reason, r=r, mark=mark):
            died.setdefault(r.replica_id, time.monotonic())
            mark(reason)

        r.mark_dead = marked
    return died


def test_killed_and_hung_replicas_lose_nothing(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """Three replicas: one is SIGKILLed, one hangs (SIGSTOP); both are detected within 10 s,
    their requests go to the third, training continues and every prompt of both epochs is
    trained exactly once."""
    run = tmp_path / "run"
    args = [
        *_base(tiny_model_dir, epoch_files, digits_reward, run),
        "rollout.num_replicas=3",
        "trainer.async.replica_health_interval_s=0.5",
        "trainer.async.replica_health_timeout_s=5",  # the stopped one: silent, no CPU progress
        "trainer.async.max_replica_restarts=0",  # the third replica carries the rest
    ]
    trainer = RLTrainer(load_config(None, args))
    reps = trainer.ctx.fleet.replicas
    died = _record_deaths(trainer)
    struck: dict[int, float] = {}

    def strike(i: int, sig: int):
        def do(_):
            struck[i] = time.monotonic()
            os.kill(reps[i].process.pid, sig)
            if sig == signal.SIGSTOP:  # wait for the watchdog (the trainer keeps its own pace)
                assert reps[i].wait_dead(300), "the stopped replica was not declared hung"

        return do

    try:
        _fit_with_faults(
            trainer,
            {
                "step5:after_gen": strike(0, signal.SIGKILL),
                "step9:after_gen": strike(1, signal.SIGSTOP),
            },
        )
    finally:
        for r in reps:
            if r.process.poll() is None:
                r.process.kill()
        trainer.close()
    assert sorted(died) == [0, 1] and not reps[2].dead, died  # the third was never dead
    assert "exited" in reps[0].dead_reason or "connection" in reps[0].dead_reason
    assert "/health" in reps[1].dead_reason
    _each_prompt_once_per_epoch(run)
    rows = metric_rows(run)
    assert rows[-1]["rollout/replica_failures"] == 2
    assert rows[-1]["rollout/live_replicas"] == 1
    assert rows[-1]["rollout/reissued_requests"] > 0, "no request of a dead replica re-issued"


def test_no_replica_left_is_a_named_error(tiny_model_dir, epoch_files, digits_reward, tmp_path):
    """The only replica dies and no restart is allowed: the run stops with the named error."""
    args = [
        *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
        "trainer.async.max_replica_restarts=0",
    ]
    trainer = RLTrainer(load_config(None, args))
    rep = trainer.ctx.fleet.replicas[0]
    try:
        with pytest.raises(ReplicaDeadError) as e:
            _fit_with_faults(trainer, {"step3:after_gen": lambda _: rep.process.kill()})
    finally:
        trainer.close()
    assert "no rollout replica is left" in str(e.value)


def test_a_dead_replica_is_restarted_and_serves_the_pushed_weights(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """Two replicas; one is SIGKILLed at step 3: its requests go to the other, a new process
    starts in its slot, joins at a later push with exactly that push's weights and serves;
    every prompt of both epochs is trained once."""
    run = tmp_path / "run"
    args = [
        *_base(tiny_model_dir, epoch_files, digits_reward, run),
        "rollout.num_replicas=2",
        *FAST_HEALTH,
        "trainer.async.max_replica_restarts=1",
    ]
    trainer = RLTrainer(load_config(None, args))
    fleet = trainer.ctx.fleet
    first = fleet.replicas[0]
    old_pid = first.process.pid
    joined: list[tuple[int, int]] = []  # (fleet version, the new replica's version) at install
    install = fleet.install

    def spy(slot, replica, open_source):
        install(slot, replica, open_source)
        joined.append((fleet.version, replica.policy_version))

    fleet.install = spy

    try:
        _fit_with_faults(
            trainer,
            {
                "step3:after_gen": lambda _: os.kill(old_pid, signal.SIGKILL),
                "step8:after_gen": lambda t: await_replacement(t, first),
            },
        )
        new = fleet.replicas[0]
        assert new is not first and not new.dead and new.process.pid != old_pid
        busy = new.busy_s
    finally:
        trainer.close()
    assert len(joined) == 1 and joined[0][0] == joined[0][1] > 1, joined
    assert busy > 0, "the restarted replica never generated"
    _each_prompt_once_per_epoch(run)
    last = metric_rows(run)[-1]
    assert last["rollout/replica_failures"] == 1
    assert last["rollout/replica_restarts"] == 1
    assert last["rollout/live_replicas"] == 2


def test_the_only_replica_dies_and_its_restart_carries_the_run(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """One replica, SIGKILLed mid-rollout: its requests wait for the restart, which joins at
    once with the actor's current weights as a new version; the run finishes and every prompt
    of both epochs is trained once."""
    run = tmp_path / "run"
    args = [
        *_base(tiny_model_dir, epoch_files, digits_reward, run),
        *FAST_HEALTH,
        "trainer.async.max_replica_restarts=1",
    ]
    trainer = RLTrainer(load_config(None, args))
    fleet = trainer.ctx.fleet
    first = fleet.replicas[0]
    try:
        _fit_with_faults(trainer, {"step3:after_gen": lambda _: first.process.kill()})
        new = fleet.replicas[0]
        assert new is not first and not new.dead
        assert new.policy_version == fleet.version
    finally:
        trainer.close()
    _each_prompt_once_per_epoch(run)
    last = metric_rows(run)[-1]
    assert last["rollout/replica_failures"] == 1 and last["rollout/replica_restarts"] == 1
    assert last["rollout/live_replicas"] == 1


def test_fully_async_kill_and_resume_loses_and_duplicates_nothing(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """SIGKILL the whole run mid-epoch (groups buffered and in flight, checkpoint at step 4),
    resume: every prompt of both epochs trained once; the replica processes die with it."""
    run = tmp_path / "run"
    args = [*_base(tiny_model_dir, epoch_files, digits_reward, run), "trainer.save_freq=4"]
    assert train_subprocess(args, threads=1, kill_at="step6:after_gen") == -9
    deadline = time.monotonic() + 120  # they die with their parent (PR_SET_PDEATHSIG)
    while _replica_pids(tiny_model_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _replica_pids(tiny_model_dir), "a rollout replica outlived its killed trainer"
    assert train_subprocess(args, threads=1) == 0
    _each_prompt_once_per_epoch(run)


def _fit_throttled(trainer) -> None:
    """Fit with the (one) dedicated replica running a seventh of the time (SIGSTOP 30 ms,
    SIGCONT 5 ms), then close the trainer."""
    pid, stop = trainer.ctx.fleet.replicas[0].process.pid, threading.Event()

    def throttle():
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.03)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.005)

    th = threading.Thread(target=throttle, daemon=True)
    th.start()
    try:
        trainer.fit()
    finally:
        stop.set()
        th.join()
        os.kill(pid, signal.SIGCONT)
        trainer.close()


def test_the_wait_strategy_takes_mini_batches_within_the_bound(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """``staleness_strategy=wait`` with mini-batch steps (4 groups per version taken as two
    takes of 2): nothing is dropped, every prompt is trained once within the bound (the
    feasibility check counts what the current version can still take; it used to assume a
    whole batch per take and raise StalenessBoundError at the first version)."""
    run = tmp_path / "run"
    overrides = [
        *_base(tiny_model_dir, epoch_files, digits_reward, run, steps=8),  # one epoch
        "rollout.response_length=64",
        "trainer.async.staleness_strategy=wait",
    ]
    _fit_throttled(RLTrainer(load_config(None, overrides)))
    rows = metric_rows(run)
    assert not any(r.get("replay/evicted/stale") for r in rows)
    assert max(r["replay/staleness/max"] for r in rows) <= 1
    _each_prompt_once_per_epoch(run, epochs=1)


def test_idle_switch_decision():
    from postrl.trainer.asynchronous.idle_switch import should_switch

    kw = dict(ready_groups=0, needed_groups=2, weights_current=True, cost_s=0.05)
    assert should_switch("never", predicted_wait_s=9.0, **kw) == (False, "never")
    assert should_switch("auto", predicted_wait_s=None, **kw) == (False, "unmeasured")
    assert should_switch("auto", predicted_wait_s=0.04, **kw) == (False, "cheap_wait")
    assert should_switch("auto", predicted_wait_s=0.06, **kw) == (True, "pays")
    assert should_switch("always", predicted_wait_s=None, **kw) == (True, "forced")
    assert should_switch("always", predicted_wait_s=9.0, **{**kw, "ready_groups": 2}) == (
        False,
        "ready",
    )
    assert should_switch("always", predicted_wait_s=9.0, **{**kw, "weights_current": False}) == (
        False,
        "weights",
    )
    with pytest.raises(ValueError, match="not one of"):
        should_switch("sometimes", predicted_wait_s=1.0, **kw)


def test_idle_switch_config_errors_name_the_field_and_the_fix(small_overrides):
    fa = [*small_overrides, "trainer.mode=fully_async", "trainer.async.parameter_sync_step=2"]
    with pytest.raises(ConfigError, match="trainer.async.idle_switch='maybe' must be one of"):
        RLTrainer(load_config(None, [*fa, "trainer.async.idle_switch=maybe"]))
    with pytest.raises(ConfigError, match="set trainer.backend=local or trainer.async.idle_sw"):
        RLTrainer(load_config(None, [*fa, "trainer.async.idle_switch=auto", "trainer.backend=ray"]))
    with pytest.raises(ConfigError, match="idle_switch=always with trainer.mode=sync"):
        RLTrainer(load_config(None, [*small_overrides, "trainer.async.idle_switch=always"]))


def test_idle_switch_generates_on_the_trainers_cores_and_loses_nothing(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """``idle_switch=always``: at every step right after a push whose batch is not complete, the
    trainer's in-process replica serves with exactly the pushed version; at the switch-out its
    requests are resumed on the dedicated replica; every prompt is trained once (groups gone
    stale are generated again), every token within the staleness bound and no newer than the
    fleet's version."""
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *_base(tiny_model_dir, epoch_files, digits_reward, run),
            "trainer.async.idle_switch=always",
            "rollout.response_length=64",  # generation outlasts the update: the trainer waits
        ],
    )
    trainer = RLTrainer(cfg)
    switch = trainer.mode.switch
    assert switch is not None and switch.replica.standby and switch.cost_s > 0
    seen = []
    update = trainer.roles.update_actor

    def spy(batch):
        v = batch.batch["rollout_policy_version"]
        mask = batch.batch["response_mask"].bool()
        assert switch.replica.standby and switch.replica.load == 0, "trained while switched in"
        seen.append((trainer.ctx.fleet.version, v[mask].min().item(), v[mask].max().item()))
        return update(batch)

    trainer.roles.update_actor = spy
    # the dedicated replica cannot keep up: the trainer waits at the steps after a push
    _fit_throttled(trainer)
    rows = metric_rows(run)
    # the starved replica makes groups stale in most runs (switch-outs hand requests back):
    # each is evicted and its own prompt generated again, so every prompt of an epoch is still
    # trained once (before the retry, such a run lost the prompt to a fresh one)
    _each_prompt_once_per_epoch(run)
    for current, oldest, newest in seen:
        assert current - oldest <= 1 and newest <= current
    switched = [r for r in rows if r["async/switch/switched"] == 1.0]
    assert switched, "the batch was never incomplete at a step after a push"
    assert all(r["step"] % 2 == 1 for r in switched), "switched while the actor was ahead"
    assert sum(r["async/switch/moved_in"] for r in switched) > 0, "nothing was moved over"
    # (before aborts waited for the replica's stream to open, the moved requests of a switch at
    # step 1 could run on at the replica: about 1 run in 6 generated nothing here)
    assert sum(r["async/switch/gen_s"] for r in switched) > 0, "the local replica never ran"
    assert all(r["async/switch/in_s"] > 0 and r["async/switch/out_s"] >= 0 for r in switched)


def test_cores_are_lent_only_where_the_split_leaves_them_to_the_replicas(monkeypatch):
    """The trainer borrows replica cores only when its own threads and theirs fit the machine:
    a trainer on every core (num_threads 0 or all of them) would oversubscribe."""
    import os

    from postrl.config import load_config
    from postrl.trainer.context import lends_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)

    def cfg(*over: str):
        return load_config(None, ["trainer.mode=fully_async", *over])

    assert lends_cores(cfg("trainer.num_threads=1", "trainer.async.rollout_threads=1"))
    assert not lends_cores(cfg("trainer.num_threads=0"))  # torch's default: every core
    assert not lends_cores(cfg("trainer.num_threads=2", "trainer.async.rollout_threads=1"))
    assert not lends_cores(cfg("trainer.num_threads=1", "rollout.num_replicas=2"))
    assert not lends_cores(cfg("trainer.num_threads=1", "trainer.lend_cores=false"))
    assert not lends_cores(cfg("trainer.num_threads=1", "trainer.backend=ray"))
