"""Rollout replicas in processes of their own, served over HTTP on 127.0.0.1.

``spawn_replica(model_path, ...)`` starts ``python -m postrl.rollout.remote``: a process that
loads one rollout backend with its own torch thread count and serves it with the token routes
of ``postrl.rollout.server`` (``/v1/generate``, ``/v1/abort``, ``/v1/weights/bucket``,
``/health``, ...) plus a multiplexed JSON-lines TCP stream for generate/abort (one
connection carries every in-flight request, each line tagged with an id; both ports bind
127.0.0.1 and are printed by the child). The returned :class:`HTTPRolloutReplica` has the
surface of
:class:`~postrl.rollout.client.RolloutReplica` (``load``, ``policy_version``, async
``generate``, ``abort``, ``pause``/``resume``, ``receive_bucket``, ``update_weights``), so the
load balancer, the resuming client and the weight-sync backends drive it unchanged.

Failure is explicit. A replica whose process died (connection refused or reset) or that has
not answered ``/health`` for ``timeout_s`` (:class:`ReplicaWatchdog`; one failed ping or a
transport error on a live process is retried on a fresh connection first) is marked
**dead**: every request waiting on it fails at once with :class:`ReplicaDeadError`, which the
:class:`~postrl.rollout.client.RolloutClient` answers by re-issuing the request (prompt plus
the tokens of its earlier segments) to a live replica. Nothing received is unpickled: requests
and answers are JSON, weights are ``postrl.weights`` frames (raw bytes + JSON header). The
process dies with its parent (``PR_SET_PDEATHSIG`` and a parent watch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from postrl.rollout.liveness import Liveness
from postrl.rollout.types import (
    ReplicaDeadError,
    RolloutError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

__all__ = [
    "HTTPRolloutReplica",
    "ReplicaDeadError",
    "ReplicaWatchdog",
    "process_cpu_ticks",
    "spawn_replica",
    "replica_main",
]

logger = logging.getLogger(__name__)
_PORT_LINE = "POSTRL_REPLICA_PORT="
_LINE_LIMIT = 64 << 20  # longest JSON line on a replica stream (bytes)
_RETRIES = 2  # transport errors retried (fresh connection) before a live process counts as dead


class HTTPRolloutReplica(Liveness):
    """Handle to a replica served over HTTP (see the module docstring).

    Args:
        base_url: ``http://127.0.0.1:PORT`` of the replica's server.
        replica_id: index in logs and errors.
        request_timeout_s: deadline of one generate request.
        control_timeout_s: deadline of control calls (abort, pause, weights, health).
        process: the replica's ``subprocess.Popen`` when this side started it (closed with
            the handle).
        log_path: where the process writes its log (named in errors).
        stream_port: the replica's multiplexed JSON-lines port for generate/abort (0: use
            ``/v1/generate``). One TCP connection carries every in-flight request, so hundreds
            of concurrent requests cost the trainer's event loop a line each way, not an HTTP
            exchange (httpx's connection pool spends most of a busy loop's time on itself).
    """

    def __init__(
        self,
        base_url: str,
        replica_id: int = 0,
        *,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        process: subprocess.Popen | None = None,
        log_path: str | None = None,
        stream_port: int = 0,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.replica_id = replica_id
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.process = process
        self.log_path = log_path
        self.policy_version = 0
        self.standby = False
        """Out of service without being dead (nothing is routed to it)."""
        self.last_swap: dict[str, float] = {}
        self.last_received: dict[str, int] = {}
        """``{name: crc32}`` of the last complete update, as the replica loaded it."""
        self.busy_s = 0.0
        """The replica engine's seconds in steps, as of the last health ping."""
        Liveness.__init__(self)
        self._inflight = 0
        self._http = httpx.Client(base_url=self.base_url, timeout=control_timeout_s)
        self._aclient: Any = None
        self.stream_port = stream_port
        self._channel: _Channel | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._wsock: Any = None  # the blocking connection weight frames travel on
        self._wfile: Any = None

    # ------------------------------------------------------------------ state
    @property
    def load(self) -> int:
        """In-flight requests sent through this handle."""
        return self._inflight

    @property
    def local_pid(self) -> int | None:
        """The replica's process id when this side started it (it runs on this machine), for
        the watchdog's CPU-progress check; else None."""
        return self.process.pid if self.process is not None else None

    def process_gone(self) -> str | None:
        """Why the replica's process is gone (its exit code and log), or None while it runs
        (or when this side did not start it)."""
        if self.process is not None and self.process.poll() is not None:
            return f"process exited with code {self.process.returncode} (log: {self.log_path})"
        return None

    # ------------------------------------------------------------------ generation
    def _async_client(self) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:
            self._aloop = loop
            self._aclient = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=httpx.Timeout(self.request_timeout_s, connect=self.control_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._aclient

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Run one request on the replica; :class:`ReplicaDeadError` when it dies meanwhile."""
        body = {
            "prompt_ids": list(prompt_ids),
            "sampling": _sampling_json(sampling),
            "request_id": request_id,
        }
        self._inflight += 1
        try:
            return await self.race(self._post_generate(body))
        finally:
            self._inflight -= 1

    async def _post_generate(self, body: dict[str, Any]) -> TokenOutput:
        """One generate over the replica's multiplexed stream (``stream_port``) or, without
        one, over HTTP; transport errors are retried on a fresh connection, and the replica is
        declared dead once its process is gone or the retries are used up."""
        import httpx

        for attempt in range(_RETRIES + 1):
            try:
                if self.stream_port:
                    d = await asyncio.wait_for(
                        self._stream().call({"op": "generate", **body}), self.request_timeout_s
                    )
                    if "error" in d:
                        raise RolloutError(f"replica {self.replica_id}: {d['error']}")
                    break
                r = await self._async_client().post("/v1/generate", json=body)
                if r.status_code != 200:
                    raise RolloutError(
                        f"replica {self.replica_id}: HTTP {r.status_code}: {r.text[:500]}"
                    )
                d = r.json()
                break
            except (httpx.TimeoutException, asyncio.TimeoutError) as e:
                raise RolloutTimeoutError(
                    f"replica {self.replica_id}: request {body['request_id']!r} exceeded "
                    f"{self.request_timeout_s}s"
                ) from e
            except (httpx.TransportError, ConnectionError, OSError) as e:  # dead, or a lost link
                gone = self.process_gone()
                if gone is None and attempt < _RETRIES:
                    await asyncio.sleep(0.05 * (attempt + 1))
                    continue
                reason = gone or f"connection failed {_RETRIES + 1} times ({type(e).__name__}: {e})"
                self.mark_dead(reason)
                raise ReplicaDeadError(self.replica_id, reason) from e
        return TokenOutput(
            list(d["token_ids"]),
            list(d["log_probs"]),
            d["finish_reason"],
            d.get("stop_reason"),
            [(int(n), int(v)) for n, v in d.get("versions") or []],
        )

    def _stream(self) -> _Channel:
        loop = asyncio.get_running_loop()
        ch = self._channel
        if ch is None or ch.loop is not loop or ch.broken:
            ch = self._channel = _Channel(loop, self.stream_port)
        return ch

    # ------------------------------------------------------------------ control
    def _post(self, route: str, **kw: Any) -> dict[str, Any]:
        return self._request("POST", route, **kw)

    def _get(self, route: str) -> dict[str, Any]:
        return self._request("GET", route)

    def _request(self, method: str, route: str, **kw: Any) -> dict[str, Any]:
        """One control call (JSON answer); transport errors are retried on a fresh connection,
        then the replica counts as dead; a non-200 answer is a ``RolloutError``."""
        import httpx

        self.check_alive()
        for attempt in range(_RETRIES + 1):
            try:
                r = self._http.request(method, route, **kw)
                break
            except httpx.TransportError as e:  # timeouts included: a hung replica is dead too
                gone = self.process_gone()
                if (
                    gone is None
                    and attempt < _RETRIES
                    and not isinstance(e, httpx.TimeoutException)
                ):
                    time.sleep(0.05 * (attempt + 1))  # a connection closed under us: again
                    continue
                reason = gone or f"{route} failed ({type(e).__name__}: {e})"
                self.mark_dead(reason)
                raise ReplicaDeadError(self.replica_id, reason) from e
        if r.status_code != 200:
            raise RolloutError(
                f"replica {self.replica_id}: {route} → HTTP {r.status_code}: {r.text[:500]}"
            )
        return r.json()

    def abort(self, request_id: str) -> None:
        """Abort one request (fire and forget from inside an event loop; a dead replica has
        nothing left to abort)."""
        if self.dead:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            try:
                self._post("/v1/abort", json={"request_id": request_id})
            except ReplicaDeadError:
                pass
            return
        loop.create_task(self._abort_async(request_id))

    async def _abort_async(self, request_id: str) -> None:
        import httpx

        if self.stream_port:
            try:
                await self._stream().send({"op": "abort", "request_id": request_id})
            except (ConnectionError, OSError):
                pass  # the watchdog decides whether the replica is dead
            return
        try:
            await self._async_client().post(
                "/v1/abort", json={"request_id": request_id}, timeout=self.control_timeout_s
            )
        except httpx.HTTPError:  # the watchdog decides whether the replica is dead
            pass

    def pause(self) -> None:
        """Abort in-flight requests and hold new ones (``RolloutReplica.pause``)."""
        self._post("/v1/pause")

    def resume(self) -> None:
        """Serve again after :meth:`pause`."""
        self._post("/v1/resume")

    def sleep(self) -> None:
        """Release the replica's KV cache."""
        self._post("/v1/sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` released."""
        self._post("/v1/wake_up")

    def receive_bucket(self, frame: bytes) -> dict[str, Any]:
        """Send one ``postrl.weights`` frame; the replica swaps the weights in atomically at the
        frame marked ``last`` (its answer, returned, carries the swap's pause and recompute
        times).

        With a ``stream_port`` the frame travels as raw bytes on a connection of its own
        (a header line, then the bytes; ~10× faster than an HTTP body of the same size:
        W1's 9.7 MB push took 75 ms over HTTP); otherwise as the body of
        ``POST /v1/weights/bucket``."""
        if self.stream_port:
            d = self._send_frame_raw(frame)
        else:
            d = self._post(
                "/v1/weights/bucket",
                content=frame,
                headers={"content-type": "application/octet-stream"},
            )
        self.policy_version = int(d.get("policy_version", self.policy_version))
        if d.get("swap"):
            self.last_swap = {k: float(v) for k, v in d["swap"].items()}
        if "received" in d:
            self.last_received = {k: int(v) for k, v in d["received"].items()}
        return d

    def receive_bucket_report(self, frame: bytes) -> dict[str, Any]:
        """:meth:`receive_bucket`, answered as ``RolloutReplica.receive_bucket_report`` is
        (policy version; at an update's last frame ``swap`` and ``received``): a server in
        front of this replica (``postrl serve`` of a backend that runs in a process of its
        own) relays the replica's own answer."""
        d = self.receive_bucket(frame)
        return {k: d[k] for k in ("policy_version", "swap", "received") if k in d}

    def status(self) -> dict[str, Any]:
        """The replica's ``/health`` answer (policy version, running / waiting requests, busy
        seconds), within ``control_timeout_s``."""
        return self._get("/health")

    @property
    def max_model_len(self) -> int | None:
        """Tokens per sequence the replica's engine holds (its ``/v1/models``; asked once)."""
        if not hasattr(self, "_max_model_len"):
            cards = self._get("/v1/models").get("data") or [{}]
            n = cards[0].get("max_model_len")
            self._max_model_len = int(n) if n else None
        return self._max_model_len

    def _send_frame_raw(self, frame: bytes) -> dict[str, Any]:
        """One frame over a blocking connection to the stream port (opened once, kept; a
        lost one is opened again once, then the replica is declared dead)."""
        import socket

        self.check_alive()
        head = json.dumps({"op": "weights", "id": 1, "nbytes": len(frame)}).encode() + b"\n"
        for attempt in range(_RETRIES + 1):
            try:
                if self._wsock is None:
                    self._wsock = socket.create_connection(
                        ("127.0.0.1", self.stream_port), timeout=self.control_timeout_s
                    )
                    self._wfile = self._wsock.makefile("rb")
                self._wsock.sendall(head)
                self._wsock.sendall(frame)
                line = self._wfile.readline(_LINE_LIMIT)
                if not line:
                    raise ConnectionError("replica closed the weights connection")
                break
            except (OSError, ConnectionError) as e:  # socket.timeout included: hung is dead
                self._close_wsock()
                gone = self.process_gone()
                if gone is None and attempt < _RETRIES and not isinstance(e, TimeoutError):
                    time.sleep(0.05 * (attempt + 1))
                    continue
                reason = gone or f"weights push failed ({type(e).__name__}: {e})"
                self.mark_dead(reason)
                raise ReplicaDeadError(self.replica_id, reason) from e
        d = json.loads(line)
        if "error" in d:
            raise RolloutError(f"replica {self.replica_id}: weights frame rejected: {d['error']}")
        return d

    def _close_wsock(self) -> None:
        if self._wsock is not None:
            try:
                self._wfile.close()
                self._wsock.close()
            except OSError:
                pass
        self._wsock = self._wfile = None

    def update_weights(
        self,
        weights: Iterable[WeightItem],
        version: int | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """Stream a per-tensor weight stream as bucket frames (one update, one swap)."""
        from postrl.weights import encode_frame, pack_buckets

        for bucket in pack_buckets(weights, bucket_bytes, version=version):
            self.receive_bucket(encode_frame(bucket))

    async def health(self, timeout_s: float) -> dict[str, Any]:
        """``/health`` within ``timeout_s`` (raises on failure)."""
        r = await self._async_client().get("/health", timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def kill(self) -> None:
        """SIGKILL the replica's process (a dead or hung one, before a restart) and close."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.close()

    def close(self) -> None:
        """Stop the replica's process (when this side started it) and the HTTP clients."""
        self._http.close()
        self._close_wsock()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        aclient, self._aclient = self._aclient, None
        if aclient is not None and self._aloop is not None and not self._aloop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._aloop:
                running.create_task(aclient.aclose())
            elif not self._aloop.is_running():
                self._aloop.run_until_complete(aclient.aclose())
            else:  # the loop runs in another thread: close there, with a deadline
                fut = asyncio.run_coroutine_threadsafe(aclient.aclose(), self._aloop)
                try:
                    fut.result(timeout=self.control_timeout_s)
                except Exception:  # noqa: BLE001 (closing: nothing left to report to)
                    fut.cancel()


class _Channel:
    """Client end of a replica's JSON-lines stream: requests carry an ``id``; one reader task
    resolves each answer's future. A lost connection fails every pending call with
    ``ConnectionError`` (the caller retries on a new channel or declares the replica dead)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, port: int) -> None:
        self.loop = loop
        self.port = port
        self.broken = False
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None

    async def _open(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=_LINE_LIMIT)
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

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send ``msg`` and await its answer."""
        await self._ensure()
        if self.broken or self._writer is None:
            raise ConnectionError("replica stream closed")
        self._next += 1
        rid, fut = self._next, self.loop.create_future()
        self._pending[rid] = fut
        self._writer.write(json.dumps({"id": rid, **msg}).encode() + b"\n")
        try:
            return await fut
        finally:
            self._pending.pop(rid, None)

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


async def _serve_stream(
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
                frame = await reader.readexactly(int(d["nbytes"]))
                ans: dict[str, Any] = {"id": d["id"]}
                try:
                    ans.update(replica.receive_bucket_report(frame))
                except ValueError as e:  # a malformed frame: named to the sender
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


class ReplicaWatchdog:
    """Pings every live replica's ``/health`` every ``interval_s`` and declares dead (its
    waiting requests fail at once and are re-issued by the client) a replica

    - whose process is gone (exited, or Ray reported the actor dead): at once;
    - that has not answered for ``timeout_s`` **and** whose process made no CPU progress in
      the last ``timeout_s`` (a stopped or deadlocked process: a hang);
    - that has not answered for ``busy_timeout_s`` although its process kept running (a
      livelock, or a machine so loaded that the replica is useless).

    A replica that misses pings while its process keeps working is *slow*, not dead: on a
    loaded machine a busy replica can be silent for seconds (its event loop starved of CPU),
    and declaring it dead would throw away its work and spend a restart on it. Each such
    missed ping is counted in :attr:`busy_pings`. CPU progress is read from ``/proc`` for a
    process on this machine (``local_pid`` of the handle); elsewhere silence alone decides.
    Run :meth:`run` as a task on the loop the agent loops use.

    Args:
        replicas: out-of-process replica handles (:class:`HTTPRolloutReplica`,
            :class:`~postrl.rollout.ray_replica.RayRolloutReplica`: ``dead``, async ``health``,
            ``process_gone``, ``mark_dead``, ``busy_s``, ``local_pid``), read afresh each round
            (a restarted replica joins).
        interval_s: time between two rounds of pings.
        timeout_s: silence (with no CPU progress) after which a replica is hung.
        busy_timeout_s: silence after which a replica is dead even though its process runs
            (default ``max(10 × timeout_s, 60)``).
    """

    def __init__(
        self,
        replicas: list[Any],
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        busy_timeout_s: float | None = None,
    ) -> None:
        self.replicas = replicas
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.busy_timeout_s = (
            max(10.0 * timeout_s, 60.0) if busy_timeout_s is None else busy_timeout_s
        )
        self.failures = 0
        self.busy_pings = 0
        """Pings missed by a replica whose process kept working (not declared dead)."""
        self._last_ok: dict[int, float] = {}  # id(handle) -> monotonic time of its last answer
        self._cpu: dict[int, tuple[int, float]] = {}  # id(handle) -> (CPU ticks, when they moved)

    async def check(self) -> None:
        """One round of pings (concurrent)."""
        live = [r for r in self.replicas if not r.dead]
        results = await asyncio.gather(
            *(r.health(self.timeout_s) for r in live), return_exceptions=True
        )
        now = time.monotonic()
        for r, res in zip(live, results, strict=True):
            last = self._last_ok.setdefault(id(r), now)  # a restarted replica: a new handle
            progress = self._cpu_progress(r, now)
            if isinstance(res, dict):
                r.busy_s = float(res.get("busy_s", r.busy_s))
                self._last_ok[id(r)] = now
                continue
            if isinstance(res, asyncio.CancelledError):
                continue
            gone = r.process_gone()
            silent = now - last
            if gone is None and silent < self.timeout_s:
                continue  # one failed ping (e.g. a connection closed under us) is not death
            working = progress is not None and now - progress < self.timeout_s
            if gone is None and working and silent < self.busy_timeout_s:
                self.busy_pings += 1  # silent but working: slow (a loaded machine), not hung
                logger.info(
                    "rollout replica %d: no /health answer for %.1fs but its process is "
                    "working; not declared dead before %.0fs of silence",
                    r.replica_id,
                    silent,
                    self.busy_timeout_s,
                )
                continue
            if gone is None:
                gone = f"no /health answer for {silent:.1f}s"
                if working:
                    gone += " although its process kept running"
                elif progress is not None:
                    gone += f" and no CPU progress for {now - progress:.1f}s"
                gone += f" ({type(res).__name__}: {res})"
            r.mark_dead(gone)
            self.failures += 1

    def _cpu_progress(self, r: Any, now: float) -> float | None:
        """When the replica's process last used CPU (monotonic time; None: not readable)."""
        ticks = process_cpu_ticks(r.local_pid)
        if ticks is None:
            return None
        seen = self._cpu.get(id(r))
        if seen is None or seen[0] != ticks:
            seen = (ticks, now)
            self._cpu[id(r)] = seen
        return seen[1]

    async def run(self) -> None:
        """Ping until cancelled."""
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)


def process_cpu_ticks(pid: int | None) -> int | None:
    """User + system CPU time of process ``pid`` on this machine, in clock ticks (all its
    threads; ``/proc/PID/stat``), or None when it cannot be read (no pid, not Linux, gone)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    try:
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (IndexError, ValueError):
        return None


def _sampling_json(sp: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_new_tokens": sp.max_new_tokens,
        "stop_token_ids": list(sp.stop_token_ids),
        "stop": list(sp.stop),
        "seed": sp.seed,
        "logprobs": sp.logprobs,
        "ignore_eos": sp.ignore_eos,
        "priority": sp.priority,
    }


# ---------------------------------------------------------------------- spawning
def spawn_replica(
    model_path: str | Path,
    *,
    backend: str = "native",
    options: dict[str, Any] | None = None,
    threads: int = 1,
    nice: int = 0,
    replica_id: int = 0,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 120.0,
    request_timeout_s: float = 600.0,
    control_timeout_s: float = 60.0,
    python: str | None = None,
) -> HTTPRolloutReplica:
    """Start one replica process serving ``backend`` for ``model_path`` with ``threads`` torch
    threads; returns its handle once ``/health`` answers (``RolloutError`` naming the log
    otherwise). ``options`` are the backend's constructor options (JSON values); ``nice``
    lowers the process's CPU priority (``os.nice``: the OS then gives it the cores the trainer
    leaves idle); ``python`` is the interpreter to run (default: this one; a backend with
    packages of its own, e.g. ``vllm``, runs its venv's: ``base.replica_python``)."""
    log = Path(log_path) if log_path else None
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    if python and python != sys.executable:  # another venv runs this source tree's postrl
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [
        python or sys.executable,
        "-m",
        "postrl.rollout.remote",
        "--model",
        str(model_path),
        "--backend",
        backend,
        "--threads",
        str(threads),
        "--nice",
        str(nice),
        "--options",
        json.dumps(options or {}),
        "--parent-pid",
        str(os.getpid()),
    ]
    errf = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=env, text=True)
    finally:
        if log:
            errf.close()
    port, stream_port = _read_port(proc, startup_timeout_s, log)
    rep = HTTPRolloutReplica(
        f"http://127.0.0.1:{port}",
        replica_id,
        stream_port=stream_port,
        request_timeout_s=request_timeout_s,
        control_timeout_s=control_timeout_s,
        process=proc,
        log_path=str(log) if log else None,
    )
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            d = rep._http.get("/health", timeout=5).json()
            rep.policy_version = int(d.get("policy_version", 0))
            return rep
        except Exception as e:  # noqa: BLE001 (retried until the deadline)
            if proc.poll() is not None or time.monotonic() > deadline:
                rep.close()
                raise RolloutError(
                    f"rollout replica {replica_id} did not come up within {startup_timeout_s}s "
                    f"({type(e).__name__}: {e}); see its log {log}"
                ) from e
            time.sleep(0.05)


def _read_port(proc: subprocess.Popen, timeout_s: float, log: Path | None) -> tuple[int, int]:
    """The HTTP and stream ports the child prints on its first stdout line (with a deadline)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    line = box[0] if box else None
    if line is None or not line.startswith(_PORT_LINE):
        proc.kill()
        if line is None:
            why = f"did not report its port within {timeout_s}s (it may still be loading)"
        elif not line:
            why = f"closed its stdout before reporting its port (exit code {proc.poll()})"
        else:  # something else wrote to the replica's stdout first (e.g. an engine's logging)
            why = (
                f"printed {line[:200].rstrip()!r} before its port line ({_PORT_LINE}...): "
                "the replica's stdout must carry the port line first"
            )
        raise RolloutError(f"rollout replica process {why}; see its log {log}")
    http, stream = line[len(_PORT_LINE) :].strip().split(",")
    return int(http), int(stream)


def _die_with_parent(parent_pid: int) -> None:
    try:  # Linux: the kernel kills us when the parent dies
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:  # other systems (and a reparented child)
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def replica_main(argv: list[str] | None = None) -> int:
    """Entry of a replica process (``python -m postrl.rollout.remote``): bind 127.0.0.1 on a
    free port, print it, serve the token routes until terminated."""
    p = argparse.ArgumentParser(prog="python -m postrl.rollout.remote")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="native")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=0, help="added to the process's niceness")
    p.add_argument("--options", default="{}", help="backend options as a JSON object")
    p.add_argument("--parent-pid", type=int, default=0)
    a = p.parse_args(argv)
    if a.parent_pid:
        _die_with_parent(a.parent_pid)
    if a.nice:
        os.nice(a.nice)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import socket

    import torch
    import uvicorn

    from postrl.rollout.base import create_rollout_backend
    from postrl.rollout.client import RolloutClient, RolloutReplica
    from postrl.rollout.server import create_app

    torch.set_num_threads(max(1, a.threads))
    backend = create_rollout_backend(a.backend, a.model, **json.loads(a.options))
    replica = RolloutReplica(backend)
    app = create_app(replica)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(  # idle keep-alive connections stay open (no close/reuse race)
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=3600)
    )
    client = RolloutClient(replica)

    async def main() -> None:
        stream = await asyncio.start_server(
            lambda r, w: _serve_stream(client, r, w, replica), "127.0.0.1", 0, limit=_LINE_LIMIT
        )
        sport = stream.sockets[0].getsockname()[1]
        sys.stdout.write(f"{_PORT_LINE}{sock.getsockname()[1]},{sport}\n")
        sys.stdout.flush()
        await server.serve(sockets=[sock])

    try:
        asyncio.run(main())
    finally:  # an engine with processes of its own (vllm) shuts them down
        if callable(getattr(backend, "close", None)):
            backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(replica_main())
