"""The replica watchdog and the restarter decide from facts, not from a loaded machine's timing.

Real processes: a CPU-burning child stands for a replica that is busy but whose event loop is
starved (it answers no ping), a SIGSTOPped child for a hung one. The handles around them are
test scaffolding with the real ``Liveness`` mixin; the watchdog reads the children's CPU time
from ``/proc``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from postrl.rollout import ReplicaRestartError
from postrl.rollout.fleet import RolloutFleet
from postrl.rollout.liveness import Liveness
from postrl.rollout.restart import ReplicaRestarter
from postrl.rollout.watchdog import ReplicaWatchdog, process_cpu_ticks

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


class _Silent(Liveness):
    """A replica handle whose pings never come back (its process may still work)."""

    def __init__(self, replica_id: int, proc: subprocess.Popen | None) -> None:
        Liveness.__init__(self)
        self.replica_id = replica_id
        self.proc = proc
        self.busy_s = 0.0
        self.killed = False

    @property
    def local_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def health(self, timeout_s: float) -> dict:
        await asyncio.sleep(timeout_s)
        raise TimeoutError("no answer")

    def process_gone(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"process exited with code {self.proc.returncode}"
        return None

    def kill(self) -> None:
        self.killed = True

    def close(self) -> None:
        pass


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_silent_but_working_replica_is_spared_and_a_stopped_one_is_hung():
    busy = _child("while True: pass")
    stopped = _child("import time; time.sleep(600)")
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        reps = [_Silent(0, busy), _Silent(1, stopped)]
        dog = ReplicaWatchdog(reps, interval_s=0.05, timeout_s=0.6, busy_timeout_s=30)

        async def until(pred, limit_s: float) -> None:
            deadline = time.monotonic() + limit_s
            while not pred():
                assert time.monotonic() < deadline, [r.dead_reason for r in reps]
                await dog.check()

        asyncio.run(until(lambda: reps[1].dead, 120))
        assert "no CPU progress" in reps[1].dead_reason, reps[1].dead_reason
        t0 = process_cpu_ticks(busy.pid)
        asyncio.run(until(lambda: process_cpu_ticks(busy.pid) > t0 and dog.busy_pings > 0, 120))
        assert not reps[0].dead, reps[0].dead_reason  # silent for seconds, but working
        assert dog.failures == 1

        # past the busy deadline even a working replica is dead (a livelock is not service)
        dog.busy_timeout_s = 1.0
        asyncio.run(until(lambda: reps[0].dead, 120))
        assert "although its process kept running" in reps[0].dead_reason
        assert reps[0].wait_dead(0) and dog.failures == 2
    finally:
        for p in (busy, stopped):
            p.kill()
            p.wait()


def test_silence_alone_decides_for_a_process_elsewhere():
    rep = _Silent(0, None)  # no local pid: a replica on another machine
    dog = ReplicaWatchdog([rep], interval_s=0.05, timeout_s=0.3)

    async def run() -> None:
        while not rep.dead:
            await dog.check()

    asyncio.run(asyncio.wait_for(run(), 120))
    assert rep.dead_reason.startswith("no /health answer for") and dog.busy_pings == 0


def test_a_failed_restart_is_retried_then_a_named_error():
    dead = [_Silent(0, None), _Silent(1, None)]
    for r in dead:
        r.mark_dead("killed")
    fleet = RolloutFleet(list(dead), weight_sync=None)
    tries: list[int] = []

    def spawn(slot: int) -> _Silent:
        tries.append(slot)
        if slot == 0 and len(tries) > 1:
            return _Silent(slot, None)  # slot 0's second try comes up
        raise RuntimeError(f"model of slot {slot} failed to load")

    rs = ReplicaRestarter(fleet, spawn, budget=3)
    rs.begin()  # slot 0 and slot 1 start (2 of 3 restarts)
    rs.wait_started(120)
    assert rs.install(lambda v: None) == 0 and rs.failed == 2
    assert fleet.replicas == dead  # nothing installed: both slots still hold dead handles
    with pytest.raises(ReplicaRestartError) as e:  # the last restart goes to slot 0 again,
        rs.begin()  # and slot 1, whose restart failed, has none left: a named error
    assert e.value.slot == 1 and "failed to load" in str(e.value)
    assert "max_replica_restarts" in str(e.value)
    rs.wait_started(120)
    assert rs.install(lambda v: None) == 1 and fleet.replicas[0] is not dead[0]
    assert fleet.restarts == 1 and dead[0].killed and tries == [0, 1, 0]
    rs.close()


def test_a_restart_is_expected_at_every_moment_of_its_begin(monkeypatch):
    """While the trainer's thread begins the last restart, a request on another thread asks
    ``expected()`` (budget left, or a replacement pending) to decide whether to wait or fail:
    it must never read False in between (it did when the budget dropped before the
    replacement was recorded: a CI failure of the only-replica-dies test)."""
    import postrl.rollout.restart as restart_mod

    dead = _Silent(0, None)
    dead.mark_dead("killed")
    fleet = RolloutFleet([dead], weight_sync=None)
    rs = ReplicaRestarter(fleet, lambda slot: _Silent(slot, None), budget=1)
    seen: list[bool] = []
    submit = rs._pool.submit

    def spy_submit(*a, **k):
        seen.append(rs.expected())
        return submit(*a, **k)

    monkeypatch.setattr(rs._pool, "submit", spy_submit)
    monkeypatch.setattr(restart_mod.logger, "warning", lambda *a, **k: seen.append(rs.expected()))
    rs.begin()
    seen.append(rs.expected())
    assert seen == [True, True, True] and rs.left == 0
    rs.wait_started(120)
    assert rs.install(lambda v: None) == 1 and not rs.expected()
    rs.close()


def test_every_replica_kind_implements_the_protocol(tiny_model_dir):
    """The in-process, subprocess and Ray replica classes all satisfy ``Replica`` (the remote
    ones ``RemoteReplica``): the fleet and the balancer probe none of them."""
    from postrl.rollout import RemoteReplica, Replica, RolloutReplica, create_rollout_backend
    from postrl.rollout.http_replica import HTTPRolloutReplica
    from postrl.rollout.ray_replica import RayRolloutReplica

    local = RolloutReplica(create_rollout_backend("native", tiny_model_dir, max_model_len=32))
    assert isinstance(local, Replica) and not isinstance(local, RemoteReplica)
    assert not local.dead and local.dead_reason is None and not local.standby
    http = HTTPRolloutReplica("http://127.0.0.1:9", 0)  # a handle; nothing is contacted
    ray_handle = RayRolloutReplica(actor=None, replica_id=1)
    for h in (http, ray_handle):
        assert isinstance(h, RemoteReplica) and isinstance(h, Replica)
        assert not h.dead and not h.standby and h.local_pid is None
    http.close()
    local.close()


def test_a_signal_wakes_a_waiter_from_another_thread_and_times_out():
    import threading

    from postrl.rollout.signal import Signal

    sig, state = Signal(), {"open": False}

    async def waiter() -> tuple[bool, bool]:
        opener = threading.Timer(0.2, lambda: (state.update(open=True), sig.notify()))
        opener.start()
        woke = await sig.wait_for(lambda: state["open"], 120)
        late = await sig.wait_for(lambda: False, 0.05)  # nobody notifies: the deadline
        return woke, late

    assert asyncio.run(waiter()) == (True, False)
