"""vLLM's token-in/token-out route on the postrl server: ``POST /inference/v1/generate``.

Clients written for vLLM's scale-out route (e.g. ``verifiers``' training client, which renders
the chat template itself and sends token ids) work against ``postrl serve`` unchanged::

    POST /inference/v1/generate
    {"model": "...", "token_ids": [...], "request_id": "...",
     "sampling_params": {"max_tokens": 32, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                         "seed": 0, "stop_token_ids": [...], "stop": [...], "n": 1,
                         "ignore_eos": false, "logprobs": 1, "skip_special_tokens": false, ...}}
    →
    {"request_id": "...", "prompt_logprobs": null, "kv_transfer_params": null,
     "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop",
                  "logprobs": {"content": [{"token": "token_id:42", "logprob": -0.3,
                                            "bytes": null, "top_logprobs": []}, ...]}}],
     "usage": {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C}}

What is honoured: ``max_tokens`` (default: the server's ``default_max_tokens``),
``temperature``, ``top_p``, ``top_k`` (0 or -1: off), ``seed`` (choice ``i`` samples with
``seed + i``), ``stop_token_ids``, ``stop``, ``ignore_eos``, ``n``, ``priority`` and
``logprobs`` (None: ``logprobs`` is null; ``k >= 0``: the sampled token's log-prob per
position, and with ``k > 1`` also the ``k`` most likely tokens in ``top_logprobs``, from the
server's scoring copy). The log-probs are those of the sampling distribution
(``log_softmax(logits / T)``; vLLM's ``logprobs_mode=processed_logprobs``), the ones an RL
trainer needs. ``model`` is not checked (one model per server).

Sampling keys that would change the distribution and that the engines do not implement
(``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_p``,
``min_tokens``, ``logit_bias``, ``bad_words``, ``allowed_token_ids``, ``prompt_logprobs``,
structured output, ...) are accepted at their neutral value and refused (400, naming the key)
otherwise. Every other key — output-only ones such as ``skip_special_tokens``,
``detokenize``, ``flat_logprobs``, ``extra_args``, and any this server does not know — is
ignored, **never silently**: the response header ``X-Postrl-Ignored-Keys`` lists them, the
first occurrence of each is logged, and ``GET /inference/v1/ignored_keys`` counts them since
the server started. Multimodal inputs (``features``, ``content_parts``) and ``stream=true``
are refused.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from postrl.rollout.types import SamplingParams

__all__ = ["IGNORED_HEADER", "add_token_routes", "logprobs_content", "parse_generate_request"]

logger = logging.getLogger(__name__)

IGNORED_HEADER = "X-Postrl-Ignored-Keys"

#: sampling keys this route implements
_HONOURED = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "stop",
    "ignore_eos",
    "n",
    "logprobs",
}
#: keys that change the distribution: accepted at these (neutral) values only
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "min_p": (0, 0.0, None),
    "min_tokens": (0, None),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "prompt_logprobs": (None, 0),
    "best_of": (None, 1),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "truncate_prompt_tokens": (None,),
}
#: top-level keys: handled here (``model`` is accepted and not checked)
_TOP = {"model", "token_ids", "sampling_params", "request_id", "stream", "priority"}
_REFUSED_TOP = {"features": "multimodal features", "content_parts": "multimodal content parts"}


def _int(v: Any, key: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"sampling_params.{key}={v!r}: must be an integer >= {lo}")
    return v


def _num(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"sampling_params.{key}={v!r}: must be a number")
    return float(v)


def parse_generate_request(
    body: Any, default_max_tokens: int
) -> tuple[list[int], SamplingParams, int, int | None, list[str]]:
    """Validate a request body: ``(token_ids, sampling, n, logprobs k or None, ignored keys)``.

    Raises ``ValueError`` (→ 400) naming the field for malformed or unsupported values.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with token_ids and sampling_params")
    ids = body.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise ValueError("token_ids: must be a non-empty list of non-negative integers")
    for key, what in _REFUSED_TOP.items():
        if body.get(key) not in (None, [], {}):
            raise ValueError(f"{key}: {what} are not supported (text-only models)")
    if body.get("stream"):
        raise ValueError("stream=true is not supported on /inference/v1/generate")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise ValueError("sampling_params: must be a JSON object")
    ignored = [k for k in body if k not in _TOP and k not in _REFUSED_TOP]
    for key, ok in _NEUTRAL.items():
        if key in sp and not any(sp[key] == v and type(sp[key]) is not bool for v in ok):
            raise ValueError(
                f"sampling_params.{key}={sp[key]!r} is not supported by this server (it "
                f"samples without it); leave it out or at {ok[0]!r}"
            )
    ignored += [f"sampling_params.{k}" for k in sp if k not in _HONOURED and k not in _NEUTRAL]
    top_k = _int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1, "top_k", -1)
    lp = sp.get("logprobs")
    stop = sp.get("stop") or ()
    sampling = SamplingParams(
        temperature=_num(sp.get("temperature", 1.0), "temperature"),
        top_p=_num(sp.get("top_p", 1.0), "top_p"),
        top_k=-1 if top_k == 0 else top_k,
        max_new_tokens=_int(sp.get("max_tokens") or default_max_tokens, "max_tokens", 1),
        stop_token_ids=tuple(_int(t, "stop_token_ids", 0) for t in sp.get("stop_token_ids") or ()),
        stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
        seed=None if sp.get("seed") is None else _int(sp["seed"], "seed", 0),
        ignore_eos=bool(sp.get("ignore_eos", False)),
        priority=int(body.get("priority") or 0),
    )
    n = _int(sp.get("n", 1), "n", 1)
    k = None if lp is None else _int(lp, "logprobs", 0)
    return list(ids), sampling, n, k, ignored


def add_token_routes(
    app: FastAPI,
    client: Any,
    default_max_tokens: int,
    top_logprobs: Any = None,
) -> Counter[str]:
    """Mount ``POST /inference/v1/generate`` and ``GET /inference/v1/ignored_keys`` on ``app``.

    Args:
        app: the server's FastAPI app (its ``ValueError`` handler answers 400).
        client: ``generate(prompt_ids, sampling, request_id)`` → ``TokenOutput``.
        default_max_tokens: ``max_tokens`` when the request names none.
        top_logprobs: source of ``top_logprobs`` for ``logprobs > 1``
            (:class:`postrl.rollout.server.TopLogprobs`); None refuses such requests.

    Returns:
        The counter of ignored keys (also served by the ``ignored_keys`` route).
    """
    ignored_counts: Counter[str] = Counter()

    @app.post("/inference/v1/generate")
    async def inference_generate(request: Request):
        try:
            body = await request.json()
        except ValueError as e:
            raise ValueError(f"the body is not JSON ({e})") from e
        ids, sp, n, k, ignored = parse_generate_request(body, default_max_tokens)
        for key in ignored:
            if not ignored_counts[key]:
                logger.warning(
                    "/inference/v1/generate ignores %s (listed in the %s response header and "
                    "counted at GET /inference/v1/ignored_keys)",
                    key,
                    IGNORED_HEADER,
                )
            ignored_counts[key] += 1
        if k is not None and k > 1 and top_logprobs is None:
            raise ValueError(
                f"sampling_params.logprobs={k}: this server computes no top_logprobs (started "
                "without a scorer); ask for logprobs=1 (the sampled token's log-prob)"
            )
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        seeds = [None if sp.seed is None else sp.seed + i for i in range(n)]
        outs = await asyncio.gather(
            *[
                client.generate(ids, SamplingParams(**{**sp.__dict__, "seed": s}), f"{rid}-{i}")
                for i, s in enumerate(seeds)
            ]
        )
        choices = []
        for i, o in enumerate(outs):
            lp = None
            if k is not None:
                tops: list[Any] = [[]] * len(o.token_ids)
                if k > 1:
                    tops = await asyncio.to_thread(
                        top_logprobs.top, ids, o.token_ids, k, sp.temperature
                    )
                lp = {"content": logprobs_content(o.token_ids, o.log_probs, tops)}
            choices.append(
                {
                    "index": i,
                    "token_ids": list(o.token_ids),
                    "logprobs": lp,
                    "finish_reason": o.finish_reason,
                }
            )
        completion = sum(len(o.token_ids) for o in outs)
        out = {
            "request_id": rid,
            "choices": choices,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
            },
        }
        headers = {IGNORED_HEADER: ",".join(ignored)} if ignored else None
        return JSONResponse(out, headers=headers)

    @app.get("/inference/v1/ignored_keys")
    async def ignored_keys():
        return {"ignored_keys": dict(ignored_counts)}

    return ignored_counts


def logprobs_content(ids: list[int], logprobs: Any, tops: list[Any]) -> list[dict[str, Any]]:
    """vLLM's ``logprobs.content`` with ``return_tokens_as_token_ids``: one entry per token."""
    lps = list(logprobs) if logprobs else [0.0] * len(ids)
    return [
        {
            "token": f"token_id:{t}",
            "logprob": float(lp),
            "bytes": None,
            "top_logprobs": [
                {"token": f"token_id:{a}", "logprob": float(v), "bytes": None} for a, v in top
            ],
        }
        for t, lp, top in zip(ids, lps, tops)
    ]
