"""A rollout replica in a process of its own: how it is started and what it runs.

:func:`spawn_replica` (the parent's side) starts ``python -m postrl.rollout.replica_process``
and returns an :class:`~postrl.rollout.http_replica.HTTPRolloutReplica` once ``/health``
answers. :func:`replica_main` (the child's side) loads one rollout backend with its own torch
thread count and serves it with the token routes of :mod:`postrl.rollout.server` plus the
multiplexed JSON-lines stream of :mod:`postrl.rollout.jsonl_channel`; both bind 127.0.0.1 on
free ports, which the child prints as its first stdout line (:data:`PORT_LINE`). The process
dies with its parent (``PR_SET_PDEATHSIG`` and a parent watch).
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
from pathlib import Path
from typing import Any

from postrl.rollout.http_replica import HTTPRolloutReplica
from postrl.rollout.jsonl_channel import LINE_LIMIT, serve_replica_stream
from postrl.rollout.types import RolloutError

__all__ = ["PORT_LINE", "spawn_replica", "replica_main"]

PORT_LINE = "POSTRL_REPLICA_PORT="
"""Prefix of the child's first stdout line: ``POSTRL_REPLICA_PORT=<http>,<stream>``."""


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
    shared_dir: str | None = None,
    core_lease: str = "",
) -> HTTPRolloutReplica:
    """Start one replica process serving ``backend`` for ``model_path`` with ``threads`` torch
    threads; returns its handle once ``/health`` answers (``RolloutError`` naming the log
    otherwise). ``options`` are the backend's constructor options (JSON values); ``nice``
    lowers the process's CPU priority (``os.nice``: the OS then gives it the cores the trainer
    leaves idle); ``python`` is the interpreter to run (default: this one; a backend with
    packages of its own, e.g. ``vllm``, runs its venv's: ``base.replica_python``);
    ``shared_dir`` is a directory this process shares with the caller: weight buckets in a
    :class:`~postrl.weights.buckets.SharedWeightBuffer` file there travel as headers only, and
    ``core_lease`` (a name) is its :class:`~postrl.protocol.cores.CoreOwner` lease there: the
    process lends its cores while it has no request in flight."""
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
        "postrl.rollout.replica_process",
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
    if shared_dir:
        cmd += ["--shared-dir", shared_dir]
        if core_lease:
            cmd += ["--core-lease", core_lease]
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
        shared_dir=shared_dir,
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
    if line is None or not line.startswith(PORT_LINE):
        proc.kill()
        if line is None:
            why = f"did not report its port within {timeout_s}s (it may still be loading)"
        elif not line:
            why = f"closed its stdout before reporting its port (exit code {proc.poll()})"
        else:  # something else wrote to the replica's stdout first (e.g. an engine's logging)
            why = (
                f"printed {line[:200].rstrip()!r} before its port line ({PORT_LINE}...): "
                "the replica's stdout must carry the port line first"
            )
        raise RolloutError(f"rollout replica process {why}; see its log {log}")
    http, stream = line[len(PORT_LINE) :].strip().split(",")
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
    """Entry of a replica process (``python -m postrl.rollout.replica_process``): bind
    127.0.0.1 on a free port, print it, serve the token routes until terminated."""
    p = argparse.ArgumentParser(prog="python -m postrl.rollout.replica_process")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="native")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=0, help="added to the process's niceness")
    p.add_argument("--options", default="{}", help="backend options as a JSON object")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument(
        "--shared-dir",
        default="",
        help="a directory shared with the trainer: weight buffers it may map, core leases",
    )
    p.add_argument(
        "--core-lease",
        default="",
        help="NAME in --shared-dir: lend this process's cores (postrl.protocol.cores) when idle",
    )
    a = p.parse_args(argv)
    if a.parent_pid:
        _die_with_parent(a.parent_pid)
    if a.nice:
        os.nice(a.nice)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import socket

    import torch
    import uvicorn

    from postrl.protocol.heap import freeze_now
    from postrl.rollout.base import create_rollout_backend
    from postrl.rollout.client import RolloutClient, RolloutReplica
    from postrl.rollout.server import create_app

    torch.set_num_threads(max(1, a.threads))
    backend = create_rollout_backend(a.backend, a.model, **json.loads(a.options))
    cores = None
    if a.core_lease and a.shared_dir:
        from postrl.protocol.cores import CoreOwner

        cores = CoreOwner(a.shared_dir, a.core_lease)
    replica = RolloutReplica(backend, cores=cores, shared_dir=a.shared_dir or None)
    freeze_now()  # the loaded engine lives as long as the process: off the collector's walks
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
            lambda r, w: serve_replica_stream(client, r, w, replica),
            "127.0.0.1",
            0,
            limit=LINE_LIMIT,
        )
        sport = stream.sockets[0].getsockname()[1]
        sys.stdout.write(f"{PORT_LINE}{sock.getsockname()[1]},{sport}\n")
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
