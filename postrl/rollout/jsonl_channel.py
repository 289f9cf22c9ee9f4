"""The multiplexed JSON-lines channel between a replica handle and its replica process.

One TCP connection to a replica's stream port (127.0.0.1) carries every in-flight request:
each request is one JSON line tagged with an ``id``; each answer is one line with the same
``id``, in whatever order the requests finish. So hundreds of concurrent generates cost the
trainer's event loop a line each way, not an HTTP exchange.

Ops: ``{"op": "generate", "id": i, "prompt_ids": ..., "sampling": ..., "request_id": ...}``
(answered with a :class:`~postrl.rollout.types.TokenOutput` as JSON, or ``{"error": ...}``),
``{"op": "abort", "request_id": ...}`` (no answer), and ``{"op": "weights", "id": i,
"nbytes": n}`` followed by ``n`` raw bytes, one ``postrl.weights`` frame, or ``{"op": "weights",
"id": i, "shm": {"name", "offset", "nbytes"}, "header": {...}}`` with no bytes, a bucket in a
``SharedWeightBuffer`` file of the replica's shared directory (either answered with the
policy version and, at an update's last frame, the swap's metrics). Nothing is unpickled.

:class:`ReplicaChannel` is the client end (in the trainer, each
:class:`~postrl.rollout.http_replica.HTTPRolloutReplica` opens one per event loop; its weight
frames go over a blocking connection of their own to the same port);
:func:`serve_replica_stream` is the server end (in the replica process:
:mod:`postrl.rollout.replica_process`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

__all__ = ["LINE_LIMIT", "ReplicaChannel", "serve_replica_stream"]

LINE_LIMIT = 64 << 20
"""Longest JSON line on a replica stream (bytes)."""


class ReplicaChannel:
    """Client end of a replica's JSON-lines stream: requests carry an ``id``; one reader task
    resolves each answer's future. A lost connection fails every pending call with
    ``ConnectionError`` (the caller retries on a new channel or declares the replica dead)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, port: int) -> None:
        self.loop = loop
        self.port = port
        self.broken = False
        self.failed: Callable[[], BaseException] | None = None
        """Once :meth:`fail_all` ran (the replica was declared dead): what makes the error every
        call raises — pending calls at once, later ones before they send (a fresh instance each,
        so their tracebacks do not pile onto one object)."""
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None

    async def _open(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=LINE_LIMIT)
        self._writer = writer
        self._reader_task = self.loop.create_task(self._read(reader))

    async def _ensure(self) -> None:
        if self._writer is None:
            if self._opening is None:
                self._opening = self.loop.create_task(self._open())
            try:
                await asyncio.shield(self._opening)
            except OSError:
                self.broken = True
                raise

    async def _read(self, reader: asyncio.StreamReader) -> None:
        err: BaseException = ConnectionError("replica stream closed")
        try:
            while line := await reader.readline():
                d = json.loads(line)
                fut = self._pending.pop(int(d.pop("id")), None)
                if fut is not None and not fut.done():
                    fut.set_result(d)
        except (OSError, ValueError) as e:
            err = ConnectionError(f"replica stream failed: {e}")
        self.broken = True
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def call(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send ``msg`` and await its answer; ``asyncio.TimeoutError`` when none came within
        ``timeout_s`` (the connection's opening, on the first call, has a deadline of its own of
        the same length). The deadline is a timer on the answer's future, not
        ``asyncio.wait_for``: no task and no waiter of its own per request (W1 sends 128 a step)."""
        if self._writer is None:
            await asyncio.wait_for(self._ensure(), timeout_s)
        if self.failed is not None:
            raise self.failed()
        if self.broken or self._writer is None:
            raise ConnectionError("replica stream closed")
        self._next += 1
        rid, fut = self._next, self.loop.create_future()
        self._pending[rid] = fut
        self._writer.write(json.dumps({"id": rid, **msg}).encode() + b"\n")
        timer = None if timeout_s is None else self.loop.call_later(timeout_s, _expire, fut)
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)
            if timer is not None:
                timer.cancel()

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Fail every pending call with ``error()``, and every later one before it sends (on the
        channel's loop; from another thread use ``loop.call_soon_threadsafe``). A replica
        handle calls it when the replica is declared dead, so a request waiting on a process
        that hangs fails at once without a task of its own racing the death (W1 sends 128
        requests a step)."""
        self.failed = error
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error())

    async def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` without waiting for an answer (abort). Waits for the connection to
        open like :meth:`call` (an abort sent while the first generate calls were still
        opening it used to be dropped: the request then ran to its end)."""
        await self._ensure()
        if self._writer is None or self.broken:
            raise ConnectionError("replica stream closed")
        self._writer.write(json.dumps({"id": 0, **msg}).encode() + b"\n")

    def close(self) -> None:
        """Close the connection (from the loop's thread or any other). On a loop that no longer
        runs (its owner is done: the end of a run), the reader task is ended here, so the
        loop is not left holding a pending task ("Task was destroyed but it is pending")."""
        w = self._writer
        if w is None or self.loop.is_closed():
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(w.close)
            return
        w.close()
        task = self._reader_task
        if task is None or task.done():
            return
        task.cancel()

        async def ended() -> None:
            await asyncio.gather(task, return_exceptions=True)

        try:
            self.loop.run_until_complete(ended())
        except RuntimeError:  # another loop runs in this thread: the task ends with its loop
            pass


async def serve_replica_stream(
    client: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, replica: Any = None
):
    """Server end (in the replica process): each ``generate`` line runs as a task on the
    engine's loop; its answer is written as one line with the request's ``id``. A ``weights``
    line (``{"op": "weights", "id": i, "nbytes": n}``) is followed by ``n`` raw bytes, one
    ``postrl.weights`` frame, loaded into ``replica`` before the next line is read; its answer
    line carries the policy version (and, at an update's last frame, the swap's metrics)."""
    from postrl.rollout.server import sampling_from_json

    tasks: set[asyncio.Task[None]] = set()

    async def one(d: dict[str, Any]) -> None:
        try:
            out = await client.generate(
                d["prompt_ids"], sampling_from_json(d.get("sampling") or {}), d["request_id"]
            )
            ans: dict[str, Any] = {"id": d["id"], **out.to_dict()}
        except Exception as e:  # noqa: BLE001 (reported to the caller, who raises it)
            ans = {"id": d["id"], "error": f"{type(e).__name__}: {e}"}
        writer.write(json.dumps(ans).encode() + b"\n")

    try:
        while line := await reader.readline():
            try:
                d = json.loads(line)
            except ValueError:
                break  # not our protocol: drop the connection
            if d.get("op") == "abort":
                client.abort(str(d.get("request_id")))
            elif d.get("op") == "weights" and replica is not None:
                shm = d.get("shm")  # a bucket in a shared buffer: no bytes follow
                frame = None if shm else await reader.readexactly(int(d["nbytes"]))
                ans: dict[str, Any] = {"id": d["id"]}
                try:
                    if shm:
                        ans.update(replica.receive_shared_bucket_report(shm, d.get("header")))
                    else:
                        ans.update(replica.receive_bucket_report(frame))
                except (ValueError, OSError, KeyError) as e:  # named to the sender
                    ans["error"] = f"{type(e).__name__}: {e}"
                writer.write(json.dumps(ans).encode() + b"\n")
            elif d.get("op") == "generate":
                t = asyncio.get_running_loop().create_task(one(d))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
    except (OSError, ValueError, asyncio.IncompleteReadError):
        pass
    finally:
        for t in tasks:
            t.cancel()
        writer.close()


def _expire(fut: asyncio.Future[Any]) -> None:
    """A call's deadline passed: its answer's future fails with ``asyncio.TimeoutError``."""
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())
