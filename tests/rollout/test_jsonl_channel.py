"""The replica stream's client end: answers matched by id, and a deadline per call that fails
the call (not the channel) and ignores a late answer."""

from __future__ import annotations

import asyncio
import json

import pytest

from postrl.rollout.jsonl_channel import ReplicaChannel, _expire


async def _server(delays: dict[str, float]):
    """A real TCP server on 127.0.0.1 that answers each line with its ``echo`` after
    ``delays[echo]`` seconds (in whatever order they finish)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def answer(d: dict) -> None:
            await asyncio.sleep(delays.get(d["echo"], 0.0))
            writer.write(json.dumps({"id": d["id"], "echo": d["echo"]}).encode() + b"\n")

        tasks = set()
        while line := await reader.readline():
            t = asyncio.get_running_loop().create_task(answer(json.loads(line)))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_call_past_its_deadline_fails_alone_and_its_late_answer_is_dropped():
    async def main() -> None:
        server, port = await _server({"slow": 0.5, "fast": 0.0})
        ch = ReplicaChannel(asyncio.get_running_loop(), port)
        try:
            slow = asyncio.ensure_future(ch.call({"echo": "slow"}, timeout_s=0.1))
            fast = await ch.call({"echo": "fast"}, timeout_s=5.0)
            assert fast["echo"] == "fast"
            with pytest.raises(asyncio.TimeoutError):
                await slow
            assert ch._pending == {}  # the timed-out call left nothing behind
            await asyncio.sleep(0.6)  # its answer arrives now, for nobody
            assert not ch.broken
            again = await ch.call({"echo": "fast"}, timeout_s=5.0)  # the channel still serves
            assert again["echo"] == "fast"
            assert (await ch.call({"echo": "slow"}))["echo"] == "slow"  # no deadline: waits
        finally:
            ch.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_a_cancelled_call_cancels_its_deadline():
    async def main() -> None:
        server, port = await _server({"slow": 0.3})
        loop = asyncio.get_running_loop()
        ch = ReplicaChannel(loop, port)

        def live_deadlines() -> int:  # the loop's timer heap: this module's deadlines not cancelled
            return sum(
                getattr(h, "_callback", None) is _expire and not h.cancelled()
                for h in loop._scheduled  # noqa: SLF001
            )

        try:
            await ch.call({"echo": "warm"}, timeout_s=5.0)  # the connection is open
            assert live_deadlines() == 0
            call = asyncio.ensure_future(ch.call({"echo": "slow"}, timeout_s=60.0))
            await asyncio.sleep(0.05)
            assert live_deadlines() == 1
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert ch._pending == {} and live_deadlines() == 0
        finally:
            ch.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_fail_all_fails_the_pending_calls_at_once_and_every_later_one():
    """A replica declared dead fails its channel: a call waiting on an answer that will never
    come raises the error at once, and a later call raises it before sending."""

    async def main() -> None:
        server, port = await _server({"hang": 3600.0})
        loop = asyncio.get_running_loop()
        ch = ReplicaChannel(loop, port)
        try:
            assert (await ch.call({"echo": "ok"}))["echo"] == "ok"
            waiting = loop.create_task(ch.call({"echo": "hang"}))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            t0 = loop.time()
            loop.call_soon_threadsafe(ch.fail_all, lambda: RuntimeError("replica 0 declared dead"))
            with pytest.raises(RuntimeError, match="declared dead"):
                await waiting
            assert loop.time() - t0 < 1.0 and ch._pending == {}
            with pytest.raises(RuntimeError, match="declared dead"):
                await ch.call({"echo": "later"})
        finally:
            ch.close()
            server.close()

    asyncio.run(main())
