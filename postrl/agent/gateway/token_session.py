"""One trajectory's token-in/token-out side of the gateway: vLLM's ``/inference/v1/generate``.

A client that renders its own prompts (``verifiers``' training client: it tokenises with a
renderer and sends ids) samples through a :class:`TokenSession`. The ids it sends are the
prompt, exactly; the session samples through the agent loop's rollout client (the fleet's
backend, with the policy versions of the tokens) and records every call — prompt ids, sampled
ids, their log-probs and versions — so the loop can check the trajectory the client reports
against what was really sampled (:meth:`TokenSession.match`).

Request (``POST /t/inference/v1/generate`` on the gateway server, ``Authorization: Bearer`` the
loop's key), the route's usual body (:func:`postrl.rollout.token_route.parse_generate_request`)
with the trajectory named in ``sampling_params.extra_args.postrl_trajectory``. The trajectory's
rollout sampling is authoritative: ``temperature``, ``top_p``, ``top_k`` and the seed come from
it (request ``k`` of a trajectory samples with ``derive_seed(seed, k - 1)`` from the second on,
as the tool loop seeds its turns), ``max_tokens`` may only lower ``rollout.response_length`` (and
is cut to the room left in ``max_model_len``), ``stop_token_ids``/``stop`` add to the
trajectory's. ``n`` must be 1 and ``logprobs`` at most 1 (the sampled token's log-prob, always
returned).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from postrl.agent.base import token_versions
from postrl.agent.manager import derive_seed
from postrl.rollout.token_route import logprobs_content, parse_generate_request

__all__ = ["TokenCall", "TokenSession", "TokenSessionClosedError", "trajectory_of"]

ROUTE_KEY = "postrl_trajectory"
"""``sampling_params.extra_args`` key naming the trajectory of a token-route request."""


class TokenSessionClosedError(RuntimeError):
    """A request reached a trajectory that already ended."""


def trajectory_of(body: Any) -> str | None:
    """The trajectory id a token-route body names (``sampling_params.extra_args``), or None."""
    if not isinstance(body, dict):
        return None
    sp = body.get("sampling_params")
    extra = sp.get("extra_args") if isinstance(sp, dict) else None
    sid = extra.get(ROUTE_KEY) if isinstance(extra, dict) else None
    return sid if isinstance(sid, str) else None


@dataclass
class TokenCall:
    """One sampled call: the exact prompt ids, the sampled ids, their log-probs and versions."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int]] = field(default_factory=list)


class TokenSession:
    """The token-route state of one trajectory.

    Args:
        sid: the routing id (``extra_args.postrl_trajectory``; unguessable).
        key: the API key requests must carry.
        client: the rollout client (``generate(prompt_ids, sampling, request_id,
            trajectory_id)``).
        sampling: the trajectory's ``SamplingParams`` (authoritative, module docstring).
        request_id: the trajectory's id (rollout request ids derive from it).
        max_requests: calls allowed; the next one fails the trajectory.
        max_model_len: prompt + response capacity of one sequence (None: no limit).
    """

    def __init__(
        self,
        sid: str,
        key: str,
        client: Any,
        sampling: Any,
        request_id: str,
        max_requests: int,
        max_model_len: int | None = None,
    ) -> None:
        self.sid, self.key = sid, key
        self.client = client
        self.sampling = sampling
        self.request_id = request_id
        self.max_requests = max_requests
        self.max_model_len = max_model_len
        self.calls: list[TokenCall] = []
        self.requests = 0
        self.failure = ""
        self.closed = False
        self._lock = asyncio.Lock()

    def fail(self, reason: str) -> None:
        """Mark the trajectory failed (the first reason wins)."""
        self.failure = self.failure or reason

    def _sampling(self, sp: Any, n: int, k: int | None, n_prompt: int) -> Any:
        if n != 1:
            raise ValueError("sampling_params.n: only n=1 is supported (one trajectory per call)")
        if k is not None and k > 1:
            raise ValueError(
                f"sampling_params.logprobs={k}: the gateway returns the sampled token's "
                "log-prob only; ask for logprobs=1"
            )
        own = self.sampling
        kw: dict[str, Any] = {
            "max_new_tokens": min(sp.max_new_tokens, own.max_new_tokens),
            "stop_token_ids": tuple(dict.fromkeys((*own.stop_token_ids, *sp.stop_token_ids))),
            "stop": tuple(dict.fromkeys((*own.stop, *sp.stop))),
        }
        if own.seed is not None and self.requests > 1:  # as the tool loop seeds its turns
            kw["seed"] = derive_seed(own.seed, self.requests - 1)
        if self.max_model_len is not None:
            room = self.max_model_len - 1 - n_prompt
            if room < 1:
                self.fail("context_overflow")
                raise ValueError(
                    f"token_ids: {n_prompt} prompt tokens leave no room within the rollout's "
                    f"max_model_len={self.max_model_len}; shorten the conversation or raise "
                    "rollout.max_model_len"
                )
            kw["max_new_tokens"] = max(1, min(kw["max_new_tokens"], room))
        return replace(own, **kw)

    async def generate(self, body: Any) -> dict[str, Any]:
        """Answer one ``/inference/v1/generate`` body (vLLM's response shape, one choice)."""
        async with self._lock:
            if self.closed:
                raise TokenSessionClosedError(f"trajectory {self.request_id} has already ended")
            self.requests += 1
            if self.requests > self.max_requests:
                self.fail("too_many_requests")
                raise ValueError(
                    f"this trajectory made more than {self.max_requests} generate calls "
                    "(rollout.agent.verifiers.max_requests)"
                )
            ids, sp, n, k, _ = parse_generate_request(body, self.sampling.max_new_tokens)
            sp = self._sampling(sp, n, k, len(ids))
            out = await self.client.generate(
                ids,
                sp,
                request_id=f"{self.request_id}-t{self.requests}",
                trajectory_id=self.request_id,
            )
            gen = [int(t) for t in out.token_ids]
            lps = [float(x) for x in out.log_probs] if out.log_probs else [0.0] * len(gen)
            self.calls.append(TokenCall(list(ids), gen, lps, token_versions(out, len(gen))))
            return {
                "request_id": str(body.get("request_id") or uuid.uuid4().hex),
                "choices": [
                    {
                        "index": 0,
                        "token_ids": gen,
                        "logprobs": {"content": logprobs_content(gen, lps, [[]] * len(gen))},
                        "finish_reason": out.finish_reason,
                    }
                ],
                "prompt_logprobs": None,
                "kv_transfer_params": None,
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(gen),
                    "total_tokens": len(ids) + len(gen),
                },
            }

    def match(
        self, token_ids: list[int], sampled_mask: list[bool]
    ) -> tuple[list[tuple[int, int]], int]:
        """Check a reported sequence against the recorded calls.

        Each maximal run of sampled positions must be one call's sampled ids, whose prompt is
        the sequence up to the run. Returns the ``(num_tokens, policy_version)`` segments of
        the positions from the first sampled one on (``-1`` on unsampled positions and on runs
        no call matches) and the number of sampled positions that matched no call (drift).
        """
        start = next((i for i, m in enumerate(sampled_mask) if m), len(sampled_mask))
        segs: list[tuple[int, int]] = []
        unmatched = 0
        i, used = start, set()
        while i < len(token_ids):
            j = i
            while j < len(token_ids) and bool(sampled_mask[j]) == bool(sampled_mask[i]):
                j += 1
            if not sampled_mask[i]:
                segs.append((j - i, -1))
            else:
                run, prefix = token_ids[i:j], token_ids[:i]
                hit = next(
                    (
                        n
                        for n, c in enumerate(self.calls)
                        if n not in used and c.token_ids == run and c.prompt_ids == prefix
                    ),
                    None,
                )
                if hit is None:
                    unmatched += j - i
                    segs.append((j - i, -1))
                else:
                    used.add(hit)
                    segs.extend(self.calls[hit].versions)
            i = j
        return segs, unmatched
