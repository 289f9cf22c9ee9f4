"""The gateway's HTTP server: one per agent manager, on 127.0.0.1, routing by session.

Routes (OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}`` on failure):

- ``POST /s/{sid}/v1/chat/completions`` — the session's base URL is ``/s/{sid}/v1``; the
  request must carry ``Authorization: Bearer <the session's key>`` (401 otherwise);
- ``POST /v1/chat/completions`` — the same, routed by the key alone;
- ``GET  /s/{sid}/v1/models``, ``GET /v1/models`` — one model, ``postrl`` (any name is accepted
  in requests and ignored);
- ``POST /s/{sid}/reward`` — ``{"reward": r}``: the agent's reward for its trajectory (the
  unguessable ``sid`` is the capability; a key, if sent, must match);
- ``POST /t/inference/v1/generate`` — vLLM's token-in route for clients that render their own
  prompts (the ``verifiers`` loop; base URL ``/t/v1``), routed to a
  :class:`~postrl.agent.gateway.token_session.TokenSession` by
  ``sampling_params.extra_args.postrl_trajectory`` and the session's key;
- ``GET  /t/v1/models`` — the model ``postrl`` with its ``max_model_len`` (clients check prompt
  lengths against it before sending).

A key only reaches its own session; an unknown or ended session answers 404/410. Unknown
request keys, ``n > 1`` and other unsupported fields get a 400 naming the field. ``stream=True``
sends the finished reply as server-sent events (role chunk, one content chunk per token, tool
calls, finish reason, optional usage, ``[DONE]``): the engines have no per-token callback.

The server runs as a task on the event loop of the agent loops that use it (the trainer
context's loop), so it serves exactly while rollouts run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from postrl.agent.gateway.session import GatewayChatBody, GatewaySession, SessionClosedError
from postrl.agent.gateway.token_session import (
    TokenSession,
    TokenSessionClosedError,
    trajectory_of,
)
from postrl.rollout.openai_compat import error_body, sse

logger = logging.getLogger(__name__)

__all__ = ["GatewayServer"]

_START_TIMEOUT_S = 30.0


def _err(status: int, message: str, **kw: Any) -> Any:
    return JSONResponse(error_body(message, **kw), status)


class GatewayServer:
    """The gateway HTTP server (see the module docstring); sessions come and go per trajectory."""

    def __init__(self, max_model_len: int | None = None) -> None:
        self.sessions: dict[str, GatewaySession] = {}
        self.token_sessions: dict[str, TokenSession] = {}
        self.max_model_len = max_model_len
        """Served as the model's ``max_model_len`` by ``GET /t/v1/models`` (None: absent)."""
        self._by_key: dict[str, str] = {}
        self._server: Any = None
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    # ------------------------------------------------------------------ sessions
    def add(self, session: GatewaySession) -> None:
        """Serve ``session`` from now on."""
        self.sessions[session.sid] = session
        self._by_key[session.key] = session.sid

    def remove(self, session: GatewaySession) -> None:
        """Stop serving ``session`` (later requests get 404)."""
        session.closed = True
        self.sessions.pop(session.sid, None)
        self._by_key.pop(session.key, None)

    def add_token_session(self, session: TokenSession) -> None:
        """Serve ``session`` on the token route from now on."""
        self.token_sessions[session.sid] = session

    def remove_token_session(self, session: TokenSession) -> None:
        """Stop serving ``session`` (later requests get 404)."""
        session.closed = True
        self.token_sessions.pop(session.sid, None)

    @property
    def token_base_url(self) -> str:
        """The OpenAI base URL of the token route (its ``/inference/v1/generate`` sits beside
        ``/v1``, as on vLLM)."""
        return f"http://127.0.0.1:{self.port}/t/v1"

    def base_url(self, session: GatewaySession) -> str:
        """The session's ``OPENAI_BASE_URL``."""
        return f"http://127.0.0.1:{self.port}/s/{session.sid}/v1"

    def reward_url(self, session: GatewaySession) -> str:
        """The session's ``POSTRL_REWARD_URL``."""
        return f"http://127.0.0.1:{self.port}/s/{session.sid}/reward"

    # ------------------------------------------------------------------ lifecycle
    async def ensure_started(self) -> None:
        """Start serving on the running loop (once per loop; a new loop gets a new server)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the trainer owns signals (Ctrl-C stops the run)
                yield

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(), log_level="warning", lifespan="off", timeout_keep_alive=30
        )
        self._server = _Server(config)
        self._loop = loop
        self._task = loop.create_task(self._server.serve(sockets=[sock]))
        deadline = loop.time() + _START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(
                    f"the gateway server failed to start: {self._task.exception()!r}"
                )
            if loop.time() > deadline:
                raise TimeoutError(f"the gateway server did not start in {_START_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        logger.info("agent gateway listening on 127.0.0.1:%d", self.port)

    async def close(self) -> None:
        """Stop serving (running sessions' requests fail)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), timeout=10)
        self._server, self._task = None, None

    # ------------------------------------------------------------------ app
    def _session(self, sid: str | None, auth: str) -> GatewaySession | Any:
        key = auth[7:] if auth.startswith("Bearer ") else ""
        if sid is None:
            sid = self._by_key.get(key)
            if sid is None:
                return _err(401, "unknown API key: use the OPENAI_API_KEY of this trajectory")
        s = self.sessions.get(sid)
        if s is None:
            return _err(404, "no such trajectory (it has ended, or the URL is wrong)")
        if not hmac.compare_digest(key.encode(), s.key.encode()):
            return _err(401, "wrong API key for this trajectory", code="invalid_api_key")
        return s

    def _app(self) -> Any:
        app = FastAPI(title="postrl agent gateway")

        async def chat(request: Request, sid: str | None) -> Any:
            s = self._session(sid, request.headers.get("authorization", ""))
            if not isinstance(s, GatewaySession):
                return s
            try:
                body = GatewayChatBody.model_validate(await request.json())
            except json.JSONDecodeError as e:
                s.fail("garbage_request")
                return _err(400, f"the request body is not JSON: {e}")
            except ValidationError as e:
                first = e.errors()[0]
                param = ".".join(str(p) for p in first.get("loc", ())) or None
                why = "unknown request key" if first.get("type") == "extra_forbidden" else ""
                return _err(400, f"{param}: {why or first.get('msg')}", param=param)
            reply = await _session_call(s, s.chat(body), SessionClosedError)
            if not isinstance(reply, dict):
                return reply
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    _aiter(_chunks(reply, usage)), media_type="text/event-stream"
                )
            return reply

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat_sid(sid: str, request: Request):
            return await chat(request, sid)

        @app.post("/v1/chat/completions")
        async def chat_key(request: Request):
            return await chat(request, None)

        def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": "postrl", "object": "model", "owned_by": "postrl", "created": 0}],
            }

        @app.get("/s/{sid}/v1/models")
        async def models_sid(sid: str):
            return models()

        @app.get("/v1/models")
        async def models_key():
            return models()

        @app.get("/t/v1/models")
        async def models_token():
            card: dict[str, Any] = models()["data"][0]
            if self.max_model_len:
                card = {**card, "max_model_len": int(self.max_model_len)}
            return {"object": "list", "data": [card]}

        @app.post("/t/inference/v1/generate")
        async def generate_token(request: Request):
            try:
                body = await request.json()
            except json.JSONDecodeError as e:
                return _err(400, f"the request body is not JSON: {e}")
            sid = trajectory_of(body)
            s = self.token_sessions.get(sid or "")
            if s is None:
                return _err(
                    404,
                    "no such trajectory: sampling_params.extra_args.postrl_trajectory names none "
                    f"that is running (got {sid!r})",
                )
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {s.key}".encode()):
                return _err(401, "wrong API key for this trajectory", code="invalid_api_key")
            return await _session_call(s, s.generate(body), TokenSessionClosedError)

        @app.post("/s/{sid}/reward")
        async def reward(sid: str, request: Request):
            s = self.sessions.get(sid)
            if s is None:
                return _err(404, "no such trajectory (it has ended, or the URL is wrong)")
            auth = request.headers.get("authorization", "")
            if auth and not hmac.compare_digest(auth.encode(), f"Bearer {s.key}".encode()):
                return _err(401, "wrong API key for this trajectory", code="invalid_api_key")
            try:
                r = s.add_reward(await request.json())
            except (ValueError, SessionClosedError) as e:  # JSONDecodeError is a ValueError
                return _err(400, str(e))
            return {"ok": True, "reward": r}

        return app


async def _session_call(s: Any, call: Any, closed: type[Exception]) -> Any:
    """Await a session's ``call`` (chat or token generation): its reply, or the error response
    a failure maps to — 410 once the trajectory has ended, 400 for a bad request (with
    ``context_length_exceeded`` when it overflowed the context), 500 for a rollout failure,
    which also fails the trajectory."""
    try:
        return await call
    except closed as e:
        return _err(410, str(e))
    except ValueError as e:
        code = "context_length_exceeded" if s.failure == "context_overflow" else None
        return _err(400, str(e), code=code)
    except Exception as e:  # a rollout failure: the trajectory cannot go on
        s.fail(f"rollout_error: {type(e).__name__}")
        logger.warning("gateway %s: generation failed: %r", s.request_id, e)
        return _err(500, f"generation failed: {type(e).__name__}: {e}", kind="server_error")


async def _aiter(items: list[str]):
    for x in items:
        yield x


def _chunks(reply: dict[str, Any], usage: bool) -> list[str]:
    """The reply as ``chat.completion.chunk`` events (see the module docstring)."""
    head = {k: reply[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    ch = reply["choices"][0]
    msg = ch["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse(
            {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        )

    out = [chunk({"role": "assistant", "content": ""})]
    entries = ch["logprobs"]["content"] if ch["logprobs"] else None
    text = msg.get("content") or ""
    if entries:
        pos = 0
        for j, e in enumerate(entries):
            piece = text[pos : pos + len(e["token"])] if text.startswith(e["token"], pos) else ""
            pos += len(piece)
            if j == len(entries) - 1:
                piece += text[pos:]
            out.append(chunk({"content": piece}, logprobs={"content": [e]}))
    elif text:
        out.append(chunk({"content": text}))
    if msg.get("tool_calls"):
        calls = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
        out.append(chunk({"tool_calls": calls}))
    out.append(chunk({}, ch["finish_reason"]))
    if usage:
        out.append(sse({**head, "choices": [], "usage": reply["usage"]}))
    out.append(sse("[DONE]"))
    return out
