"""Rollout replicas in processes of their own (``postrl.rollout.replica_process``): many in-flight
requests through repeated weight pushes over HTTP at random moments — nothing aborted, no
deadlock, every token's log-prob matches the version it is tagged with; a killed replica is
detected and its requests are re-issued to another."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
import torch
from test_native_swap import TOL, _expand, _hf, _ref_logprobs, _versions

from postrl.rollout import LoadBalancer, ReplicaDeadError, RolloutClient, SamplingParams
from postrl.weights import encode_frame, pack_buckets

pytest.importorskip("uvicorn")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8], [1, 4, 1, 4, 2]]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    from postrl.rollout.replica_process import spawn_replica

    log = tmp_path_factory.mktemp("replicas")
    reps = [
        spawn_replica(
            tiny_model_dir,
            options={"max_num_seqs": 64, "max_model_len": 128},
            replica_id=i,
            log_path=log / f"r{i}.log",
        )
        for i in range(2)
    ]
    yield reps
    for r in reps:
        r.close()


def _push(rep, weights: dict[str, torch.Tensor], version: int) -> None:
    for bucket in pack_buckets(iter(weights.items()), 1 << 18, version=version):
        rep.receive_bucket(encode_frame(bucket))


def test_weights_pushed_under_load_keep_every_token_exact(replicas, tiny_model_dir):
    """24 requests of 48 tokens on one replica process while 3 new versions are pushed bucket
    by bucket at random moments (seeded): all finish whole, versions never go back, several
    requests span versions, and each token's log-prob is its tagged version's (|Δ| < TOL)."""
    rep = replicas[0]
    model = _hf(tiny_model_dir)
    versions = _versions(model, 4)
    _push(rep, versions[0], 0)  # a known start
    client = RolloutClient(LoadBalancer([rep]))
    rng = random.Random(7)
    delays = [rng.uniform(0.0, 0.15) for _ in range(3)]

    async def run():
        sp = [
            SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=100 + i)
            for i in range(24)
        ]
        tasks = [
            asyncio.ensure_future(client.generate(PROMPTS[i % 3], sp[i], f"req{i}"))
            for i in range(24)
        ]
        for v, d in enumerate(delays, start=1):
            await asyncio.sleep(d)
            await asyncio.to_thread(_push, rep, versions[v], v)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    outs = asyncio.run(run())
    assert rep.policy_version == 3
    spanning = 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 48
        tags = _expand(out.versions)
        assert len(tags) == 48 and tags == sorted(tags), out.versions
        spanning += len(set(tags)) > 1
        prompt = PROMPTS[i % 3]
        got = torch.tensor(out.log_probs)
        for v in set(tags):
            idx = [j for j, t in enumerate(tags) if t == v]
            ref = _ref_logprobs(model, versions[v], prompt, out.token_ids)
            err = (got[idx] - ref[idx]).abs().max().item()
            assert err < TOL, f"req{i}: tokens of version {v} differ by {err}"
    assert spanning > 0, "no request spanned a weight push"
    assert rep.last_swap["pause_s"] > 0


def test_a_killed_replica_is_detected_and_its_requests_reissued(replicas, tiny_model_dir):
    """Requests on a replica whose process is SIGKILLed fail over to the other replica and
    finish; the dead one is never picked again."""
    dead, alive = replicas
    lb = LoadBalancer([dead, alive])
    client = RolloutClient(lb)
    sp = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=3)

    weights = _versions(_hf(tiny_model_dir), 1)[0]
    first = next(iter(pack_buckets(iter(weights.items()), 1 << 18, version=9)))
    dead.receive_bucket(encode_frame(first))  # an update opened, never finished: engine held

    async def run():
        tasks = [
            asyncio.ensure_future(client.generate(PROMPTS[0], sp, f"k{i}", trajectory_id="t0"))
            for i in range(4)
        ]  # sticky: all on replica 0, queued behind the held engine
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks)
        os.kill(dead.process.pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 300)

    outs = asyncio.run(run())
    assert dead.dead and "exited" in dead.dead_reason
    assert all(len(o.token_ids) == 64 for o in outs)
    assert client.reissued >= 1 and not alive.dead
    assert lb.pick("t0") == 1  # the sticky trajectory moved to the live replica
    with pytest.raises(ReplicaDeadError):
        asyncio.run(dead.generate(PROMPTS[0], sp, "late"))


def test_a_hung_replica_declared_dead_fails_its_waiting_requests_at_once(tiny_model_dir, tmp_path):
    """A replica whose process hangs (SIGSTOP) answers nothing; declaring it dead from another
    thread (what the watchdog does) fails the requests waiting on its stream at once with
    ``ReplicaDeadError``, and a later request fails before it is sent."""
    import threading

    from postrl.rollout.replica_process import spawn_replica

    rep = spawn_replica(
        tiny_model_dir,
        options={"max_num_seqs": 8, "max_model_len": 128},
        log_path=tmp_path / "hung.log",
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    try:
        assert rep.stream_port

        async def run() -> float:
            await rep.generate(PROMPTS[0], sp, "warm")  # the stream is open
            os.kill(rep.process.pid, signal.SIGSTOP)
            waiting = asyncio.ensure_future(rep.generate(PROMPTS[1], sp, "stuck"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            threading.Thread(target=rep.mark_dead, args=("no answer to /health",)).start()
            with pytest.raises(ReplicaDeadError, match="no answer"):
                await asyncio.wait_for(waiting, 30)
            took = loop.time() - t0
            with pytest.raises(ReplicaDeadError):
                await rep.generate(PROMPTS[2], sp, "later")
            return took

        assert asyncio.run(run()) < 5.0
    finally:
        os.kill(rep.process.pid, signal.SIGCONT)
        rep.close()


def test_raw_weight_frames_are_checked_and_the_process_runs_at_its_niceness(
    tiny_model_dir, tmp_path
):
    """Weight frames travel raw on the stream port: a malformed one is refused by name and the
    same connection then carries a good update; ``nice`` lowers the process's priority."""
    import psutil

    from postrl.rollout import RolloutError
    from postrl.rollout.replica_process import spawn_replica

    rep = spawn_replica(
        tiny_model_dir,
        options={"max_num_seqs": 4, "max_model_len": 64},
        nice=7,
        log_path=tmp_path / "r.log",
    )
    try:
        assert rep.stream_port, "the replica has no stream port: frames would go over HTTP"
        assert psutil.Process(rep.process.pid).nice() == psutil.Process().nice() + 7
        with pytest.raises(RolloutError, match="weights frame rejected"):
            rep.receive_bucket(b"not a postrl frame")
        assert not rep.dead and rep.policy_version == 0
        _push(rep, _versions(_hf(tiny_model_dir), 1)[0], version=4)
        assert rep.policy_version == 4 and rep.last_swap["pause_s"] > 0
    finally:
        rep.close()


def test_an_abort_is_never_lost_to_the_stream_opening_or_to_overtaking(tiny_model_dir, tmp_path):
    """An abort sent while the loop's stream connection is still opening (the generate that
    opens it is waiting) reaches the replica; one that arrives before the generate it targets
    ends that generate at once. Both used to be dropped: the request ran to its end."""
    from postrl.rollout.replica_process import spawn_replica

    rep = spawn_replica(  # its own: the module's replicas may have been killed by now
        tiny_model_dir,
        options={"max_num_seqs": 8, "max_model_len": 128},
        log_path=tmp_path / "r.log",
    )
    try:
        _abort_races(rep)
    finally:
        rep.close()


def _abort_races(rep) -> None:
    sp = SamplingParams(temperature=1.0, max_new_tokens=110, ignore_eos=True, seed=3)

    async def go():
        t = asyncio.create_task(rep.generate(PROMPTS[0], sp, "open-race"))
        await asyncio.sleep(0)  # the generate runs until it waits for the connection to open
        rep.abort("open-race")
        first = await asyncio.wait_for(t, 60)
        rep.abort("overtaken")  # reaches the replica ahead of its generate
        await asyncio.sleep(0.2)
        second = await asyncio.wait_for(rep.generate(PROMPTS[1], sp, "overtaken"), 60)
        return first, second

    first, second = asyncio.run(go())  # a new loop: a new stream connection
    assert first.finish_reason == "abort" and len(first.token_ids) < 110
    assert second.finish_reason == "abort" and second.token_ids == []


def test_shared_buffer_pushes_load_exact_bytes_and_lent_cores_come_back(tiny_model_dir, tmp_path):
    """A replica process sharing a directory with the trainer: pushes travel as headers into a
    shared weight buffer (an oversized tensor's bucket still as a frame) and the replica loads
    exactly the pushed bytes; a buffer name outside the directory is refused by name; the
    process lends its core while idle and claims it back for a request."""
    from postrl.protocol.cores import CoreBorrower
    from postrl.rollout import RolloutError
    from postrl.rollout.checksum import tensor_crc
    from postrl.rollout.replica_process import spawn_replica

    shared = tmp_path / "shared"
    shared.mkdir()
    rep = spawn_replica(
        tiny_model_dir,
        options={"max_num_seqs": 4, "max_model_len": 64},
        log_path=tmp_path / "r.log",
        shared_dir=str(shared),
        core_lease="replica-0",
    )
    borrower = CoreBorrower(shared, {"replica-0": 1})
    try:
        assert rep.shares_weight_buffers
        weights = _versions(_hf(tiny_model_dir), 2)[1]
        sizes = sorted(t.numel() * t.element_size() for t in weights.values())
        bucket = sizes[-1] - 1  # the largest tensors travel as frames of their own
        assert sizes[0] < bucket
        rep.update_weights(iter(weights.items()), version=5, bucket_bytes=bucket)
        assert rep.policy_version == 5 and rep._shared is not None
        assert len(list(shared.glob("weights-0-*.buf"))) == 1
        assert rep.last_received == {k: tensor_crc(v) for k, v in weights.items()}
        with pytest.raises(RolloutError, match="refused"):
            rep._send_frame_raw(
                {"shm": {"name": "../x.buf", "offset": 0, "nbytes": 1}, "header": {"tensors": []}}
            )
        assert not rep.dead

        assert borrower.poll() == 1  # idle: its core is lent

        async def one():
            client = RolloutClient(LoadBalancer([rep]))
            sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            task = asyncio.ensure_future(client.generate(PROMPTS[0], sp, "lent"))
            await asyncio.sleep(0.5)
            assert not task.done()  # the replica waits for its core
            assert borrower.poll() == 0  # it wants it: given back
            return await asyncio.wait_for(task, 30)

        out = asyncio.run(one())
        assert len(out.token_ids) == 4
        assert rep.status()["core_wait_s"] >= 0.4
        assert borrower.poll() == 1  # idle again
    finally:
        borrower.close()
        rep.close()
    assert not list(shared.glob("weights-*.buf"))  # the handle removed its buffer
