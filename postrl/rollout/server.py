"""OpenAI-compatible HTTP server over a rollout replica (``postrl serve``).

Routes (JSON unless noted):

- ``GET  /health``, ``GET /v1/models``
- ``POST /v1/completions``       OpenAI completions (prompt: str or list of token ids)
- ``POST /v1/chat/completions``  OpenAI chat (messages and ``tools`` -> the model's chat template;
  ``tool_calls`` parsed from the reply when a tool parser is configured)
- ``POST /v1/generate``          token-in/token-out: ``{prompt_ids, sampling, request_id,
  trajectory_id}`` → ``{token_ids, log_probs, finish_reason, stop_reason, versions}``
- ``POST /v1/abort``             ``{request_id}``
- ``POST /inference/v1/generate`` vLLM's token-in route (``{model, token_ids, sampling_params}``
  → ``choices[0].token_ids`` + ``logprobs.content``), :mod:`postrl.rollout.token_route`;
  ``/v1/models`` lists ``max_model_len`` as vLLM does
- ``POST /v1/score``             token-in log-probs of given responses (a remote distillation
  teacher, :mod:`postrl.rollout.teacher`); ``GET /v1/tokenizer`` its tokenizer's fingerprint
- ``POST /v1/weights/bucket``    body = one ``postrl.weights`` frame (raw bytes + JSON header;
  never unpickled)
- ``POST /v1/pause`` / ``/v1/resume`` / ``/v1/sleep`` / ``/v1/wake_up``

The two OpenAI routes follow the API as the official ``openai`` client uses it: ``n``,
``seed`` (choice ``i`` samples with ``seed + i``: the same seed gives the same text), ``stop``
(the stop string is cut from the text), log-probs with token strings, ``top_logprobs``,
``stream=True`` as server-sent events (``stream_options.include_usage`` adds a final usage
chunk), and errors as ``{"error": {"message", "type", "param", "code"}}`` with status 400
(401 for a missing key). The engines have no per-token callback, so a stream's chunks are sent
once the generation is complete (one chunk per token; same bytes as without streaming).

``top_logprobs`` come from a Hugging Face copy of the model, loaded on the first request that
asks for them and kept in step with ``/v1/weights/bucket`` updates: ``log_softmax(logits / T)``
over the full vocabulary (``T = 1`` for greedy), the definition the engines use for the
sampled token's log-prob.

Security by default: binds 127.0.0.1; binding any other address without an API key refuses to
start; with a key every route (weights included) answers 401 unless
``Authorization: Bearer <key>`` is sent. Malformed bodies get 4xx with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import os
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from postrl.rollout.client import RolloutClient, RolloutReplica
from postrl.rollout.openai_compat import (
    ChatBody,
    CompletionBody,
    OpenAICommon,
    chat_logprobs,
    completion_logprobs,
    error_body,
    parse_tool_reply,
    render_messages,
    sse,
    trim_stop,
)
from postrl.rollout.token_route import add_token_routes
from postrl.rollout.types import RolloutError, SamplingParams

__all__ = [
    "create_app",
    "build_app",
    "start_replica",
    "serve_main",
    "check_bind",
    "TopLogprobs",
    "sampling_from_json",
]

logger = logging.getLogger(__name__)

_OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False
    priority: int = 0
    continued: int = 0


class _GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int] = Field(min_length=1)
    sampling: _Sampling = Field(default_factory=_Sampling)
    request_id: str | None = None
    trajectory_id: str | None = None


class _AbortBody(BaseModel):
    request_id: str


class _ScoreSeq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int] = Field(min_length=1)
    response_ids: list[int]


class _ScoreBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequences: list[_ScoreSeq]
    temperature: float = Field(default=1.0, gt=0)
    top_k: int = Field(default=0, ge=0, le=1024)


class TopLogprobs:
    """The ``k`` most likely tokens at each generated position, from a Hugging Face copy.

    Loaded lazily from ``model_dir``; :meth:`update` applies the same weight updates the
    engine receives. If weights changed before it was first loaded, the copy on disk is stale
    and :meth:`top` refuses (``ValueError``) rather than answer for another policy.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._model: Any = None
        self._stale = False
        self._lock = threading.Lock()

    def update(self, items: list[tuple[str, Any]]) -> None:
        """Mirror one batch of ``(HF name, tensor)`` weight updates."""
        with self._lock:
            if self._model is None:
                self._stale = True
                return
            params = dict(self._model.named_parameters())
            for name, t in items:
                if name in params:
                    params[name].data.copy_(t.to(params[name].dtype))

    def _load(self) -> None:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, torch_dtype=torch.float32
            ).eval()

    def score(
        self, sequences: list[tuple[list[int], list[int]]], temperature: float, top_k: int = 0
    ) -> Any:
        """Log-probs of each response token, and with ``top_k`` the top-k pairs
        (:func:`postrl.rollout.teacher.score_sequences`)."""
        from postrl.rollout.teacher import score_sequences

        with self._lock:
            if self._stale:
                raise ValueError(
                    "scores are unavailable: the served weights changed before the scoring "
                    "copy was loaded"
                )
            self._load()
            return score_sequences(self._model, sequences, temperature, top_k)

    def top(
        self, prompt: list[int], out: list[int], k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """Per generated token, ``k`` ``(token id, log-prob)`` pairs, most likely first."""
        import torch

        with self._lock:
            if self._stale:
                raise ValueError(
                    "top_logprobs is unavailable: the served weights changed before the scoring "
                    "copy was loaded (request top_logprobs once before pushing weights)"
                )
            self._load()
            if not out:
                return []
            ids = torch.tensor([list(prompt) + list(out)])
            with torch.no_grad():
                logits = self._model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(out)]
            t = temperature if temperature > 0 else 1.0
            lp = torch.log_softmax(logits.float() / t, dim=-1)  # (T, V)
            vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
            return [list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)]


def _sampling(b: OpenAICommon, default_max: int) -> SamplingParams:
    if b.presence_penalty or b.frequency_penalty:
        raise ValueError("presence_penalty/frequency_penalty are not supported (leave them 0)")
    stop = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
    return SamplingParams(
        temperature=b.temperature,
        top_p=b.top_p,
        top_k=b.top_k,
        stop=stop,
        seed=b.seed,
        max_new_tokens=b.max_completion_tokens or b.max_tokens or default_max,
    )


def _err(status: int, message: str, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(message, **kw), status)


def create_app(
    replica: RolloutReplica,
    tokenizer: Any = None,
    api_key: str | None = None,
    model_name: str = "postrl",
    default_max_tokens: int = 256,
    tool_parser: Any = None,
    top_logprobs: TopLogprobs | None = None,
):
    """Build the FastAPI app serving ``replica``.

    Args:
        replica: the engine replica answering requests.
        tokenizer: needed for the text routes (OpenAI completions and chat).
        api_key: when set, every route needs ``Authorization: Bearer <api_key>``.
        model_name: the id ``/v1/models`` lists and responses carry.
        default_max_tokens: completion length when the request names none.
        tool_parser: an object with ``parse(text)`` (``postrl.tools.parsers``) turning replies
            into ``tool_calls`` when a chat request carries ``tools``; None answers such
            requests with a 400.
        top_logprobs: the source of ``top_logprobs`` (None: requests for them get a 400).
    """
    app = FastAPI(title="postrl rollout server")
    client = RolloutClient(replica)
    add_token_routes(app, client, default_max_tokens, top_logprobs)  # vLLM's token-in route

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return _err(
                    401,
                    "missing or wrong API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                )
        return await call_next(request)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError):
        return _err(400, str(e))

    @app.exception_handler(RolloutError)
    async def _rollout_error(_: Request, e: RolloutError):
        return _err(400, str(e))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):
        return _err(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = f"{param}: {first.get('msg', 'invalid request')}" if param else str(e)
        # OpenAI answers bad parameters with 400; the token routes keep FastAPI's 422
        status = 400 if request.url.path in _OPENAI_ROUTES else 422
        return _err(status, msg, param=param)

    def _tok():
        if tokenizer is None:
            raise HTTPException(
                400, "this server has no tokenizer; use /v1/generate with token ids"
            )
        return tokenizer

    async def _run(ids: list[int], sp: SamplingParams, n: int):
        rid = uuid.uuid4().hex
        seeds = [None if sp.seed is None else sp.seed + i for i in range(n)]
        return await asyncio.gather(
            *[
                client.generate(ids, SamplingParams(**{**sp.__dict__, "seed": s}), f"{rid}-{i}")
                for i, s in enumerate(seeds)
            ]
        )

    async def _alternatives(ids, outs, k: int | None, temperature: float):
        if not k:
            return [None] * len(outs)
        if top_logprobs is None:
            raise ValueError("this server computes no top_logprobs (started without a scorer)")
        return [
            await asyncio.to_thread(top_logprobs.top, ids, o.token_ids, k, temperature)
            for o in outs
        ]

    def _usage(ids: list[int], outs) -> dict:
        c = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": len(ids), "completion_tokens": c, "total_tokens": len(ids) + c}

    def _head(kind: str) -> dict[str, Any]:
        return {
            "id": f"{kind}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model_name,
        }

    @app.get("/health")
    async def health():  # a replica in a process of its own answers over HTTP: off the loop
        return await asyncio.to_thread(replica.status)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "owned_by": "postrl",
                    "created": 0,
                    # vLLM's ModelCard extension: clients check prompt lengths against it
                    "max_model_len": getattr(replica, "max_model_len", None),
                }
            ],
        }

    @app.post("/v1/generate")
    async def generate(body: _GenerateBody):
        sp = sampling_from_json(body.sampling.model_dump())
        out = await client.generate(
            body.prompt_ids, sp, body.request_id or uuid.uuid4().hex, body.trajectory_id
        )
        return out.to_dict()

    @app.post("/v1/score")
    async def score(body: _ScoreBody):
        if top_logprobs is None:
            raise ValueError("this server scores nothing (started without a scorer)")
        seqs = [(s.prompt_ids, s.response_ids) for s in body.sequences]
        got = await asyncio.to_thread(top_logprobs.score, seqs, body.temperature, body.top_k)
        if body.top_k:
            return {"log_probs": got[0], "top_logprobs": got[1]}
        return {"log_probs": got}

    @app.get("/v1/tokenizer")
    async def tokenizer_info():
        from postrl.rollout.teacher import tokenizer_fingerprint

        return tokenizer_fingerprint(_tok())

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        if body.echo:
            raise ValueError("echo=True is not supported")
        tok = _tok()
        prompt = body.prompt
        ids = list(
            prompt if isinstance(prompt, list) else tok.encode(prompt, add_special_tokens=False)
        )
        outs = await _run(ids, _sampling(body, default_max_tokens), body.n)
        alts = await _alternatives(ids, outs, body.logprobs, body.temperature)
        choices = []
        for i, o in enumerate(outs):
            text = trim_stop(tok.decode(o.token_ids, skip_special_tokens=True), o.stop_reason)
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(tok, o.token_ids, o.log_probs, alts[i])
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": o.finish_reason}
            choices.append({**choice, "token_ids": o.token_ids})
        head = {**_head("cmpl"), "object": "text_completion"}
        usage = _usage(ids, outs)
        if body.stream:
            return _stream(_completion_chunks(head, choices, usage, body), 200)
        return {**head, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        tok = _tok()
        if body.response_format and body.response_format.get("type") != "text":
            raise ValueError("response_format other than 'text' is not supported")
        use_tools = bool(body.tools) and body.tool_choice != "none"
        if use_tools and tool_parser is None:
            raise ValueError("this server parses no tool calls (start it with a tool parser)")
        kwargs = {"tools": body.tools} if body.tools else {}
        ids = tok.apply_chat_template(
            render_messages(body.messages), add_generation_prompt=True, tokenize=True, **kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
        outs = await _run(ids, _sampling(body, default_max_tokens), body.n)
        k = body.top_logprobs if body.logprobs else None
        alts = await _alternatives(ids, outs, k, body.temperature)
        choices = []
        for i, o in enumerate(outs):
            text = trim_stop(tok.decode(o.token_ids, skip_special_tokens=True), o.stop_reason)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = o.finish_reason
            if use_tools:
                content, calls = parse_tool_reply(
                    tool_parser, tok, o.token_ids, text, o.stop_reason, body.tools
                )
                message["content"] = content
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls"
            lp = chat_logprobs(tok, o.token_ids, o.log_probs, alts[i]) if body.logprobs else None
            choices.append(
                {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}
            )
        head = {**_head("chatcmpl"), "object": "chat.completion"}
        usage = _usage(ids, outs)
        if body.stream:
            return _stream(_chat_chunks(head, choices, usage, body), 200)
        return {**head, "choices": choices, "usage": usage}

    @app.post("/v1/abort")
    async def abort(body: _AbortBody):
        client.abort(body.request_id)
        return {"ok": True}

    @app.post("/v1/weights/bucket")
    async def weights_bucket(request: Request):
        frame = await request.body()
        out = replica.receive_bucket_report(frame)  # ValueError (→ 400) on malformed frames
        if top_logprobs is not None:
            from postrl.weights import decode_frame, unpack_bucket

            top_logprobs.update(unpack_bucket(decode_frame(frame)))
        return {"ok": True, **out}

    @app.post("/v1/pause")
    async def pause():
        replica.pause()
        return {"ok": True}

    @app.post("/v1/resume")
    async def resume():
        replica.resume()
        return {"ok": True}

    @app.post("/v1/sleep")
    async def sleep():
        replica.sleep()
        return {"ok": True}

    @app.post("/v1/wake_up")
    async def wake_up():
        replica.wake_up()
        return {"ok": True}

    return app


def sampling_from_json(d: dict[str, Any]) -> SamplingParams:
    """``SamplingParams`` from the JSON of ``/v1/generate``'s ``sampling`` (unknown keys are
    refused; ``SamplingParams`` validates the values)."""
    return SamplingParams(
        **_Sampling(**d).model_dump(exclude={"stop_token_ids", "stop"}),
        stop_token_ids=tuple(d.get("stop_token_ids") or ()),
        stop=tuple(d.get("stop") or ()),
    )


def _stream(events, status: int) -> StreamingResponse:
    async def gen():
        for e in events:
            yield e

    return StreamingResponse(gen(), status_code=status, media_type="text/event-stream")


def _usage_event(head: dict, usage: dict, obj: str) -> str:
    return sse({**head, "object": obj, "choices": [], "usage": usage})


def _chunk(head: dict, obj: str, choice: dict[str, Any]) -> str:
    return sse({**head, "object": obj, "choices": [choice]})


def _completion_chunks(head, choices, usage, body):
    """Completions stream: one chunk per token per choice, a final chunk, usage, [DONE]."""
    obj = "text_completion"
    for ch in choices:
        i, lp = ch["index"], ch["logprobs"]
        for j, piece in enumerate(_deltas(ch["text"], lp["tokens"] if lp else None)):
            one = None
            if lp is not None and j < len(lp["tokens"]):
                one = {k: None if v is None else [v[j]] for k, v in lp.items()}
            c = {"index": i, "text": piece, "logprobs": one, "finish_reason": None}
            yield _chunk(head, obj, c)
        end = {"index": i, "text": "", "logprobs": None, "finish_reason": ch["finish_reason"]}
        yield _chunk(head, obj, end)
    if body.stream_options and body.stream_options.include_usage:
        yield _usage_event(head, usage, obj)
    yield sse("[DONE]")


def _chat_chunks(head, choices, usage, body):
    """Chat stream: role chunk, content deltas (with logprobs), tool calls, finish, usage."""
    obj = "chat.completion.chunk"
    for ch in choices:
        i, msg = ch["index"], ch["message"]
        role = {"role": "assistant", "content": ""}
        yield _chunk(head, obj, {"index": i, "delta": role, "finish_reason": None})
        entries = ch["logprobs"]["content"] if ch["logprobs"] else None
        tokens = [e["token"] for e in entries] if entries else None
        for j, piece in enumerate(_deltas(msg.get("content") or "", tokens)):
            c = {"index": i, "delta": {"content": piece}, "finish_reason": None}
            if entries is not None and j < len(entries):
                c["logprobs"] = {"content": [entries[j]]}
            yield _chunk(head, obj, c)
        if msg.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
            yield _chunk(
                head, obj, {"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}
            )
        yield _chunk(head, obj, {"index": i, "delta": {}, "finish_reason": ch["finish_reason"]})
    if body.stream_options and body.stream_options.include_usage:
        yield _usage_event(head, usage, obj)
    yield sse("[DONE]")


def _deltas(text: str, tokens: list[str] | None) -> list[str]:
    """Split ``text`` into per-token pieces that concatenate back to ``text`` exactly."""
    if not tokens:
        return [text] if text else []
    pieces, pos = [], 0
    for t in tokens:
        take = text[pos : pos + len(t)] if text.startswith(t, pos) else ""
        pieces.append(take)
        pos += len(take)
    if pos < len(text):  # decoding merged bytes differently: send the rest with the last token
        pieces[-1] += text[pos:]
    return pieces


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose the server beyond loopback without an API key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise SystemExit(
            f"refusing to bind {host!r} without an API key: anyone who can reach it could run "
            f"the model and overwrite its weights. Pass --api-key (or set POSTRL_API_KEY), or "
            f"bind 127.0.0.1"
        )


def build_app(
    model_dir: str, replica: Any, api_key: str | None = None, tool_parser: str = "hermes"
):
    """The app ``postrl serve`` runs: ``replica`` behind the OpenAI routes, with the model's
    tokenizer, a ``tool_parser`` (a ``postrl.tools.parsers`` name; '' = none) and
    ``top_logprobs`` from a lazily loaded copy of ``model_dir``. ``replica`` is a
    ``RolloutReplica``, a replica in a process of its own (``remote.HTTPRolloutReplica``: a
    backend that declares ``own_process``, e.g. ``vllm``) or a bare backend (wrapped)."""
    from transformers import AutoTokenizer

    parser = None
    if tool_parser:
        from postrl.tools.parsers import get_tool_parser  # the serving entry wires the layers

        parser = get_tool_parser(tool_parser)
    if not hasattr(replica, "receive_bucket_report"):
        replica = RolloutReplica(replica)
    return create_app(
        replica,
        AutoTokenizer.from_pretrained(model_dir),
        api_key,
        model_name=os.path.basename(os.path.normpath(str(model_dir))),
        tool_parser=parser,
        top_logprobs=TopLogprobs(str(model_dir)),
    )


def start_replica(
    backend: str,
    model_dir: str,
    options: dict[str, Any],
    python: str = "",
    log_path: str | None = None,
    startup_timeout_s: float = 900.0,
) -> Any:
    """The replica ``postrl serve`` puts behind its routes: the backend in this process, or
    (a backend whose registry entry declares ``own_process``) in a replica process of its own
    run by its venv's python (``python``, else the entry's default), driven over 127.0.0.1."""
    from postrl.rollout.base import create_rollout_backend, replica_python, runs_in_own_process

    if not runs_in_own_process(backend):
        return RolloutReplica(create_rollout_backend(backend, model_dir, **options))
    from postrl.rollout.replica_process import spawn_replica

    return spawn_replica(
        model_dir,
        backend=backend,
        options=options,
        python=replica_python(backend, python),
        log_path=log_path,
        startup_timeout_s=startup_timeout_s,
        control_timeout_s=300.0,
    )


def serve_main(argv: list[str] | None = None) -> int:
    """``postrl serve --model DIR [--backend native] [--host H] [--port P] [--api-key K]``."""
    p = argparse.ArgumentParser(prog="postrl serve", description="OpenAI-compatible rollout server")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--backend", default="native", help="rollout backend (native, hf, vllm, sglang)")
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (non-loopback needs --api-key)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", default=os.environ.get("POSTRL_API_KEY"), help="required bearer token"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--tool-parser", default="hermes", help="tool-call format of the model's replies ('' = off)"
    )
    p.add_argument(
        "--python",
        default="",
        help="interpreter of the replica process of a backend that runs in one of its own "
        "(vllm: default .venv-vllm/bin/python, built by `make vllm-venv`)",
    )
    p.add_argument(
        "--replica-log",
        default="",
        help="log file of such a replica process (default: postrl_serve_<backend>_replica.log)",
    )
    p.add_argument(
        "--startup-timeout-s", type=float, default=900.0, help="deadline of such a replica's start"
    )
    a = p.parse_args(argv)
    check_bind(a.host, a.api_key)
    import uvicorn

    opts = dict(
        device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len
    )
    log = a.replica_log or f"postrl_serve_{a.backend}_replica.log"
    replica = start_replica(a.backend, a.model, opts, a.python, log, a.startup_timeout_s)
    try:
        app = build_app(a.model, replica, a.api_key, tool_parser=a.tool_parser)
        uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    finally:
        replica.close()
    return 0
