"""Rollout interface: sampling parameters, token outputs and the backend Protocol.

Every rollout backend (``native``, ``hf``, ``vllm``, ``sglang``) is token-in/token-out: it
receives prompt token ids and returns generated token ids plus, per token, the log-probability
of the sampled token under the distribution the sampler actually used.

Log-prob convention (what the training engine recomputes as ``old_log_prob``)::

    logp_t = log_softmax(logits_t.float() / T)[y_t]          (T = temperature; T = 0 → T := 1)

computed in fp32 on the *full* temperature-scaled distribution, i.e. **before** top-k / top-p
truncation. With top-k/top-p < full the sampled token was drawn from the truncated,
renormalised distribution; we deliberately report the untruncated log-prob because that is what a
teacher-forced forward of the policy gives (verl/vLLM ``logprobs_mode="processed_logits"`` minus
truncation). Rollout-correction (truncated IS) absorbs the remaining mismatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "SamplingParams",
    "TokenOutput",
    "FinishReason",
    "RolloutBackend",
    "RolloutError",
    "RolloutTimeoutError",
    "ReplicaDeadError",
    "WeightItem",
]

FinishReason = Literal["stop", "length", "abort"]
#: one ``(name, tensor)`` pair of a per-tensor weight stream (HF parameter names).
WeightItem = tuple[str, torch.Tensor]


class RolloutError(RuntimeError):
    """A rollout backend could not serve a request (bad parameters, engine stopped, ...)."""


class RolloutTimeoutError(RolloutError, TimeoutError):
    """A rollout wait passed its deadline."""


class ReplicaDeadError(RolloutError):
    """A rollout replica's process died or stopped answering (``replica_id`` and why)."""

    def __init__(self, replica_id: int, reason: str) -> None:
        super().__init__(f"rollout replica {replica_id} is dead: {reason}")
        self.replica_id = replica_id
        self.reason = reason


class ReplicaRestartError(RolloutError):
    """A dead rollout replica could not be put back in service and no restart is left: its
    replacement failed to start or died before joining (``slot`` and why)."""

    def __init__(self, slot: int, reason: str) -> None:
        super().__init__(
            f"rollout replica {slot} could not be restarted and no restart is left "
            f"(trainer.async.max_replica_restarts): {reason}"
        )
        self.slot = slot
        self.reason = reason


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature == 0`` means greedy decoding. ``top_k <= 0`` and ``top_p >= 1`` disable those
    filters. ``seed`` makes the sample reproducible (the ``native`` backend: independent of batch
    composition); ``None`` draws a fresh seed.
    """

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; <= 0 disables."""
    max_new_tokens: int = 16
    """Maximum number of generated tokens (finish_reason "length" when reached)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the model's EOS ids are added unless ignore_eos)."""
    stop: tuple[str, ...] = ()
    """Stop strings; generation ends once the decoded completion contains one (the tokens that
    completed the match are kept)."""
    seed: int | None = None
    """Per-request sampling seed; ``None`` = random."""
    logprobs: bool = True
    """Return the sampled tokens' log-probs (see module docstring for the convention)."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS token ids."""
    priority: int = 0
    """Scheduling priority: lower is admitted first, first come first served within a
    priority (the ``native`` engine; the convention of vLLM's priority scheduling). Async modes
    pass a trajectory's dispatch step, so an interrupted older trajectory resumes before the
    next batch's fresh requests."""
    continued: int = 0
    """The last ``continued`` ids of the prompt are this request's own earlier output: a partial
    rollout continuing after an abort (the rollout client sets it). The ``native`` engine then
    keys its prompt sharing on the ids before them — the n samples of a group continue on one
    shared prompt prefill — and replays the continued ids through its batched decode instead
    of prefilling each sample's ``prompt + partial`` on its own; its output holds only the new
    tokens. Other backends treat the whole as the prompt (vLLM's prefix cache shares it)."""

    def __post_init__(self) -> None:
        errors = []
        if self.continued < 0:
            errors.append(f"continued={self.continued} must be >= 0")
        if not self.temperature >= 0:
            errors.append(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p={self.top_p} must be in (0, 1] (1 disables)")
        if self.max_new_tokens < 1:
            errors.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if isinstance(self.stop, str):
            errors.append("stop must be a tuple of strings, e.g. stop=('\\n',), not a str")
        if errors:
            raise ValueError("invalid SamplingParams: " + "; ".join(errors))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    def evolve(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes``, as ``dataclasses.replace`` — for the per-request hot path
        (every trajectory sets its seed and priority): ``self`` when nothing changes, and the
        checks of ``__post_init__`` only when a field they cover changes (an unknown field is a
        ``TypeError`` either way)."""
        unknown = changes.keys() - _SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"SamplingParams has no field {sorted(unknown)}")
        diff = {k: v for k, v in changes.items() if getattr(self, k) != v}
        if not diff:
            return self
        if diff.keys() & _SAMPLING_CHECKED:
            return dataclasses.replace(self, **diff)
        new = object.__new__(SamplingParams)
        new.__dict__.update(self.__dict__, **diff)  # frozen: filled like __init__ does
        return new


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_SAMPLING_CHECKED = frozenset(
    {"continued", "temperature", "top_p", "max_new_tokens", "stop", "stop_token_ids"}
)
"""The fields ``SamplingParams.__post_init__`` checks or normalizes."""


@dataclass
class TokenOutput:
    """Result of one ``generate`` call.

    ``log_probs[i]`` is the log-prob of ``token_ids[i]`` (empty when ``logprobs=False``).
    ``stop_reason`` is the stop token id (int) or stop string (str) that ended generation, else
    None.
    ``versions`` records, per resumed segment, ``(num_tokens, policy_version)`` (filled by the
    client; a backend returns a single segment).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-serialisable dict (used by the HTTP server)."""
        return {
            "token_ids": list(self.token_ids),
            "log_probs": list(self.log_probs),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "versions": [list(v) for v in self.versions],
        }


@runtime_checkable
class RolloutBackend(Protocol):
    """One inference engine instance.

    ``generate`` is a coroutine and may be awaited from many tasks at once. The other methods are
    plain, thread-safe calls that take effect between engine steps.
    """

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Generate one completion for ``prompt_ids``."""
        ...

    def update_weights(self, weights: Iterable[WeightItem]) -> None:
        """Load new parameters from a per-tensor stream of HF-named tensors."""
        ...

    def sleep(self) -> None:
        """Abort running requests and release the KV cache (and weights where supported)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (``tags`` ⊆ {"weights", "kv_cache"}; None = all)."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its ``generate`` returns the partial output with finish_reason
        "abort"."""
        ...
