"""A rollout replica served over HTTP on 127.0.0.1, seen from the trainer's side.

:class:`HTTPRolloutReplica` has the surface of :class:`~postrl.rollout.client.RolloutReplica`
(``load``, ``policy_version``, async ``generate``, ``abort``, ``pause``/``resume``,
``receive_bucket``, ``update_weights``), so the load balancer, the resuming client and the
weight-sync backends drive it unchanged. It talks to the replica's token routes of
:mod:`postrl.rollout.server` (``/v1/generate``, ``/v1/abort``, ``/v1/weights/bucket``,
``/health``, ...) and, when the replica has one, to its multiplexed JSON-lines stream
(:mod:`postrl.rollout.jsonl_channel`) for generate, abort and weight frames. The process behind
it is started by :func:`postrl.rollout.replica_process.spawn_replica` (or by a Ray actor:
:mod:`postrl.rollout.ray_replica`).

Failure is explicit. A replica whose process died (connection refused or reset) or that has
not answered ``/health`` for ``timeout_s`` (:class:`~postrl.rollout.watchdog.ReplicaWatchdog`;
one failed ping or a transport error on a live process is retried on a fresh connection first)
is marked **dead**: every request waiting on it fails at once with :class:`ReplicaDeadError`,
which the :class:`~postrl.rollout.client.RolloutClient` answers by re-issuing the request
(prompt plus the tokens of its earlier segments) to a live replica. Nothing received is
unpickled: requests and answers are JSON, weights are ``postrl.weights`` frames (raw bytes +
JSON header).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from postrl.rollout.jsonl_channel import LINE_LIMIT, ReplicaChannel
from postrl.rollout.liveness import Liveness
from postrl.rollout.types import (
    ReplicaDeadError,
    RolloutError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

logger = logging.getLogger(__name__)

__all__ = ["HTTPRolloutReplica", "ReplicaDeadError"]

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
        shared_dir: the directory the process was started with (``--shared-dir``): weight
            buckets packed into a :class:`~postrl.weights.buckets.SharedWeightBuffer` there
            travel as headers only (:meth:`receive_shared_bucket`).
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
        shared_dir: str | None = None,
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
        self.busy_at = 0.0
        """The replica engine's seconds in steps, as of the last health ping."""
        self.core_wait_s = 0.0
        """Seconds the replica waited for its lent cores to come back (``trainer.lend_cores``),
        as of the last health ping."""
        Liveness.__init__(self)
        self._inflight = 0
        self._http = httpx.Client(base_url=self.base_url, timeout=control_timeout_s)
        self._aclient: Any = None
        self.stream_port = stream_port
        self.shared_dir = shared_dir
        """The directory of files this replica's process shares with the trainer (weight
        buffers, core leases; None: none)."""
        self._shared: Any = None  # the SharedWeightBuffer pushes are packed into
        self._channel: ReplicaChannel | None = None
        self.on_dead(self._fail_channel)
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
            if self.stream_port:  # the channel fails its calls when the replica is declared
                self.check_alive()  # dead (_fail_channel): no race task per request
                return await self._post_generate(body)
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
                    d = await self._stream().call(
                        {"op": "generate", **body}, timeout_s=self.request_timeout_s
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

    def _stream(self) -> ReplicaChannel:
        loop = asyncio.get_running_loop()
        ch = self._channel
        if ch is None or ch.loop is not loop or ch.broken:
            ch = self._channel = ReplicaChannel(loop, self.stream_port)
            if self.dead_reason is not None:  # declared dead before this channel existed
                ch.fail_all(self._dead_error)
        return ch

    def _dead_error(self) -> ReplicaDeadError:
        return ReplicaDeadError(self.replica_id, self.dead_reason or "declared dead")

    def _fail_channel(self) -> None:
        """The replica was declared dead (on whichever thread declared it): the requests
        waiting on its channel fail with :class:`ReplicaDeadError` at once."""
        ch = self._channel
        if ch is None or ch.loop.is_closed():
            return
        try:
            ch.loop.call_soon_threadsafe(ch.fail_all, self._dead_error)
        except RuntimeError:  # the loop closed meanwhile: nothing waits on it
            pass

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
            d = self._send_frame_raw({"nbytes": len(frame)}, frame)
        else:
            d = self._post(
                "/v1/weights/bucket",
                content=frame,
                headers={"content-type": "application/octet-stream"},
            )
        return self._loaded(d)

    def _loaded(self, d: dict[str, Any]) -> dict[str, Any]:
        self.policy_version = int(d.get("policy_version", self.policy_version))
        if d.get("swap"):
            self.last_swap = {k: float(v) for k, v in d["swap"].items()}
        if "received" in d:
            self.last_received = {k: int(v) for k, v in d["received"].items()}
        return d

    @property
    def shares_weight_buffers(self) -> bool:
        """Whether this replica maps :class:`~postrl.weights.buckets.SharedWeightBuffer` files
        of :attr:`shared_dir` (a replica process started with one, on this machine)."""
        return bool(self.shared_dir and self.stream_port)

    def receive_shared_bucket(self, name: str, bucket: Any, offset: int) -> dict[str, Any]:
        """Load a bucket the trainer packed into the shared buffer ``name`` (a file of
        :attr:`shared_dir`) at ``offset``: only its header travels (the replica reads the same
        pages); answered as :meth:`receive_bucket`."""
        shm = {"name": name, "offset": int(offset), "nbytes": bucket.nbytes}
        return self._loaded(self._send_frame_raw({"shm": shm, "header": bucket.header}))

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

    def _send_frame_raw(self, line: dict[str, Any], frame: bytes | None = None) -> dict[str, Any]:
        """One ``weights`` line (plus ``frame``'s bytes) over a blocking connection to the
        stream port (opened once, kept; a lost one is opened again once, then the replica is
        declared dead)."""
        import socket

        self.check_alive()
        head = json.dumps({"op": "weights", "id": 1, **line}).encode() + b"\n"
        for attempt in range(_RETRIES + 1):
            try:
                if self._wsock is None:
                    self._wsock = socket.create_connection(
                        ("127.0.0.1", self.stream_port), timeout=self.control_timeout_s
                    )
                    self._wfile = self._wsock.makefile("rb")
                self._wsock.sendall(head)
                if frame is not None:
                    self._wsock.sendall(frame)
                line = self._wfile.readline(LINE_LIMIT)
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
        """Stream a per-tensor weight stream as buckets (one update, one swap): packed into
        this replica's :class:`~postrl.weights.buckets.SharedWeightBuffer` when its process
        shares a directory with this one (only the headers travel), else sent as frames."""
        from postrl.weights import encode_frame, pack_buckets, send_frames

        shared = self._shared_buffer(bucket_bytes)
        if shared is None:
            send_frames(weights, self.receive_bucket, version, bucket_bytes)
            return
        name = os.path.basename(shared.path)
        for bucket in pack_buckets(weights, bucket_bytes, version, buffer=shared.tensor):
            offset = shared.offset_of(bucket.payload)
            if offset is None:  # an oversized tensor's own bucket
                self.receive_bucket(encode_frame(bucket))
            else:
                self.receive_shared_bucket(name, bucket, offset)

    def _shared_buffer(self, nbytes: int) -> Any:
        """This replica's shared weight buffer of ``nbytes`` (made at the first push; None
        without a shared directory, or when its file system has no room: frames then)."""
        if not self.shares_weight_buffers:
            return None
        if self._shared is None or self._shared.nbytes < nbytes:
            from postrl.weights import SharedWeightBuffer

            self._drop_shared()
            fd, path = tempfile.mkstemp(  # a file of this handle's own: never one in use
                prefix=f"weights-{self.replica_id}-", suffix=".buf", dir=str(self.shared_dir)
            )
            os.close(fd)
            try:
                self._shared = SharedWeightBuffer(path, nbytes)
            except OSError as e:
                os.unlink(path)
                logger.warning(
                    "replica %d: no shared weight buffer of %d MB in %s (%s); weights travel "
                    "as frames",
                    self.replica_id,
                    nbytes >> 20,
                    self.shared_dir,
                    e,
                )
                self.shared_dir = None
                return None
        return self._shared

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

    def _drop_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            try:
                os.unlink(shared.path)  # its pages go when the last mapping does
            except OSError:
                pass

    def close(self) -> None:
        """Stop the replica's process (when this side started it) and the HTTP clients; remove
        its shared weight buffer."""
        self._http.close()
        self._close_wsock()
        self._drop_shared()
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
        "continued": sp.continued,
    }
