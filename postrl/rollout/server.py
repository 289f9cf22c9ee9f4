"""OpenAI-compatible HTTP server over a rollout replica (``postrl serve``).

Routes (JSON unless noted):

- ``GET  /health``, ``GET /v1/models``
- ``POST /v1/completions``       OpenAI completions (prompt: str or list of token ids)
- ``POST /v1/chat/completions``  OpenAI chat (messages → the model's chat template)
- ``POST /v1/generate``          token-in/token-out: ``{prompt_ids, sampling, request_id,
  trajectory_id}`` → ``{token_ids, log_probs, finish_reason, stop_reason, versions}``
- ``POST /v1/abort``             ``{request_id}``
- ``POST /v1/weights/bucket``    body = one ``postrl.weights`` frame (raw bytes + JSON header;
  never unpickled)
- ``POST /v1/pause`` / ``/v1/resume`` / ``/v1/sleep`` / ``/v1/wake_up``

Security by default: binds 127.0.0.1; binding any other address without an API key refuses to
start; with a key every route (weights included) answers 401 unless
``Authorization: Bearer <key>`` is sent. Malformed bodies get 4xx with a message.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from postrl.rollout.client import RolloutClient, RolloutReplica
from postrl.rollout.types import RolloutError, SamplingParams

__all__ = ["create_app", "serve_main", "check_bind"]

logger = logging.getLogger(__name__)


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


class _GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int] = Field(min_length=1)
    sampling: _Sampling = Field(default_factory=_Sampling)
    request_id: str | None = None
    trajectory_id: str | None = None


class _OpenAICommon(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=64)
    logprobs: bool | int | None = None


class _CompletionBody(_OpenAICommon):
    prompt: str | list[int]


class _Message(BaseModel):
    role: str
    content: str


class _ChatBody(_OpenAICommon):
    messages: list[_Message] = Field(min_length=1)


class _AbortBody(BaseModel):
    request_id: str


def _sampling_from_openai(b: _OpenAICommon, default_max: int) -> SamplingParams:
    stop = (b.stop,) if isinstance(b.stop, str) else tuple(b.stop or ())
    return SamplingParams(
        temperature=b.temperature,
        top_p=b.top_p,
        top_k=b.top_k,
        stop=stop,
        seed=b.seed,
        max_new_tokens=b.max_completion_tokens or b.max_tokens or default_max,
    )


def create_app(
    replica: RolloutReplica,
    tokenizer: Any = None,
    api_key: str | None = None,
    model_name: str = "postrl",
    default_max_tokens: int = 256,
):
    """Build the FastAPI app serving ``replica`` (``tokenizer`` needed for text routes)."""
    app = FastAPI(title="postrl rollout server")
    client = RolloutClient(replica)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(
                    {"error": "missing or wrong API key (send 'Authorization: Bearer <key>')"}, 401
                )
        return await call_next(request)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError):
        return JSONResponse({"error": str(e)}, 400)

    @app.exception_handler(RolloutError)
    async def _rollout_error(_: Request, e: RolloutError):
        return JSONResponse({"error": str(e)}, 400)

    def _tok():
        if tokenizer is None:
            raise HTTPException(
                400, "this server has no tokenizer; use /v1/generate with token ids"
            )
        return tokenizer

    async def _run(ids: list[int], sp: SamplingParams, n: int):
        import asyncio

        rid = uuid.uuid4().hex
        seeds = [None if sp.seed is None else sp.seed + i for i in range(n)]
        return await asyncio.gather(
            *[
                client.generate(ids, SamplingParams(**{**sp.__dict__, "seed": s}), f"{rid}-{i}")
                for i, s in enumerate(seeds)
            ]
        )

    def _usage(ids: list[int], outs) -> dict:
        c = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": len(ids), "completion_tokens": c, "total_tokens": len(ids) + c}

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": replica.policy_version}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "postrl"}],
        }

    @app.post("/v1/generate")
    async def generate(body: _GenerateBody):
        sp = SamplingParams(
            **{
                **body.sampling.model_dump(),
                "stop_token_ids": tuple(body.sampling.stop_token_ids),
                "stop": tuple(body.sampling.stop),
            }
        )
        out = await client.generate(
            body.prompt_ids, sp, body.request_id or uuid.uuid4().hex, body.trajectory_id
        )
        return out.to_dict()

    @app.post("/v1/completions")
    async def completions(body: _CompletionBody):
        ids = (
            body.prompt
            if isinstance(body.prompt, list)
            else _tok().encode(body.prompt, add_special_tokens=False)
        )
        outs = await _run(list(ids), _sampling_from_openai(body, default_max_tokens), body.n)
        choices = []
        for i, o in enumerate(outs):
            text = tokenizer.decode(o.token_ids) if tokenizer is not None else ""
            ch = {
                "index": i,
                "text": text,
                "finish_reason": o.finish_reason,
                "token_ids": o.token_ids,
            }
            if body.logprobs:
                ch["logprobs"] = {
                    "token_logprobs": o.log_probs,
                    "tokens": [str(t) for t in o.token_ids],
                }
            choices.append(ch)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(ids, outs),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: _ChatBody):
        tok = _tok()
        ids = tok.apply_chat_template(
            [m.model_dump() for m in body.messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        outs = await _run(list(ids), _sampling_from_openai(body, default_max_tokens), body.n)
        choices = []
        for i, o in enumerate(outs):
            ch = {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": tok.decode(o.token_ids, skip_special_tokens=True),
                },
                "finish_reason": o.finish_reason,
            }
            if body.logprobs:
                ch["logprobs"] = {
                    "content": [
                        {"token": str(t), "logprob": lp} for t, lp in zip(o.token_ids, o.log_probs)
                    ]
                }
            choices.append(ch)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(ids, outs),
        }

    @app.post("/v1/abort")
    async def abort(body: _AbortBody):
        client.abort(body.request_id)
        return {"ok": True}

    @app.post("/v1/weights/bucket")
    async def weights_bucket(request: Request):
        frame = await request.body()
        replica.receive_bucket(frame)  # raises ValueError (→ 400) on malformed frames
        return {"ok": True, "policy_version": replica.policy_version}

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


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose the server beyond loopback without an API key."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key:
        raise SystemExit(
            f"refusing to bind {host!r} without an API key: anyone who can reach it could run the model and "
            f"overwrite its weights. Pass --api-key (or set POSTRL_API_KEY), or bind 127.0.0.1"
        )


def serve_main(argv: list[str] | None = None) -> int:
    """``postrl serve --model DIR [--backend native] [--host 127.0.0.1] [--port 8000] [--api-key K]``."""
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
    a = p.parse_args(argv)
    check_bind(a.host, a.api_key)
    import uvicorn
    from transformers import AutoTokenizer

    from postrl.rollout.base import create_rollout_backend

    opts = dict(device=a.device, dtype=a.dtype)
    if a.backend == "native":
        opts.update(max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len)
    backend = create_rollout_backend(a.backend, a.model, **opts)
    app = create_app(
        RolloutReplica(backend),
        AutoTokenizer.from_pretrained(a.model),
        a.api_key,
        model_name=os.path.basename(os.path.normpath(a.model)),
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    return 0
