"""A real ``postrl serve`` app on 127.0.0.1 in a background thread (for tests and examples)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["start_server"]


def start_server(
    model_dir: str | Path,
    api_key: str | None = None,
    *,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    timeout_s: float = 30.0,
    replica: Any = None,
) -> tuple[str, Any, Any]:
    """Serve ``model_dir`` with the native engine on a free 127.0.0.1 port, or serve
    ``replica`` when given (e.g. a vLLM replica process from ``remote.spawn_replica``: what
    ``postrl serve --backend vllm`` puts behind its routes).

    Returns:
        ``(base url, uvicorn server, backend or replica)``; stop it with
        ``server.should_exit = True``.

    Raises:
        TimeoutError: the server did not start within ``timeout_s``.
    """
    import uvicorn

    from postrl.rollout import create_rollout_backend
    from postrl.rollout.server import build_app

    be = replica or create_rollout_backend(
        "native", str(model_dir), max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    app = build_app(str(model_dir), be, api_key)  # exactly what `postrl serve` runs
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not srv.started:
        if time.monotonic() > deadline:
            srv.should_exit = True
            raise TimeoutError(f"postrl serve of {model_dir} did not start within {timeout_s} s")
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, be
