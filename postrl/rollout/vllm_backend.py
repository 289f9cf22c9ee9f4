"""``vllm`` rollout backend (GPU; ``pip install postrl[vllm]``).

Adapts vLLM's async engine to postrl's token-in/token-out interface:

- ``generate`` → ``AsyncLLM.generate({"prompt_token_ids": ids}, SamplingParams(logprobs=0))``;
  the sampled token's log-prob comes from vLLM (``logprobs_mode="processed_logprobs"`` where
  available, i.e. after temperature, matching postrl's convention up to top-k/top-p truncation).
- ``update_weights`` → a worker extension (``PostRLWorkerExtension``) loads tensors with the
  model's own ``load_weights`` in each worker, streamed in chunks.
- ``sleep`` / ``wake_up`` → vLLM sleep mode (level 1: weights offloaded, KV cache freed).
- ``abort`` → ``AsyncLLM.abort``; the caller's ``generate`` returns the partial output.

Untested in CI (needs a GPU and vLLM); kept small and typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from postrl.rollout.base import register_rollout_backend
from postrl.rollout.loop_thread import LoopThread
from postrl.rollout.types import SamplingParams, TokenOutput, WeightItem

__all__ = ["VLLMBackend", "PostRLWorkerExtension"]


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "rollout backend 'vllm' needs vLLM: install it with `pip install postrl[vllm]`"
        ) from e
    return vllm


class PostRLWorkerExtension:
    """Mixed into vLLM workers (``worker_extension_cls``): receives weight chunks."""

    def postrl_load_weights(self, weights: list[tuple[str, Any]]) -> int:
        """Load ``(name, tensor)`` pairs with the model's ``load_weights``; returns the count."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=weights)
        return len(weights)


@register_rollout_backend("vllm", device="cuda")
class VLLMBackend:
    """vLLM ``AsyncLLM`` behind postrl's ``RolloutBackend`` interface.

    Args:
        model_path: HF model directory.
        engine_kwargs: forwarded to ``vllm.AsyncEngineArgs`` (``tensor_parallel_size``,
            ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ...).
        weight_chunk: tensors per RPC during ``update_weights``.
    """

    def __init__(self, model_path: str, weight_chunk: int = 64, **engine_kwargs: Any) -> None:
        vllm = _import_vllm()
        engine_kwargs.setdefault("enable_sleep_mode", True)
        engine_kwargs.setdefault("worker_extension_cls", f"{__name__}.PostRLWorkerExtension")
        engine_kwargs.pop("device", None)
        self._vllm = vllm
        self._loop = LoopThread("postrl-vllm")
        args = vllm.AsyncEngineArgs(model=model_path, **engine_kwargs)

        async def make() -> Any:
            return vllm.AsyncLLMEngine.from_engine_args(args)

        self.engine = self._loop.call(make(), timeout_s=1800)
        self.weight_chunk = weight_chunk

    def _params(self, sp: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=sp.max_new_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            stop=list(sp.stop),
            seed=sp.seed,
            logprobs=0 if sp.logprobs else None,
            ignore_eos=sp.ignore_eos,
        )

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """See ``RolloutBackend.generate``."""
        params = self._params(sampling)

        async def run() -> TokenOutput:
            final = None
            async for out in self.engine.generate(
                {"prompt_token_ids": list(prompt_ids)}, params, request_id
            ):
                final = out
            c = final.outputs[0]
            toks = list(c.token_ids)
            lps = (
                [d[t].logprob for t, d in zip(toks, c.logprobs or [])] if sampling.logprobs else []
            )
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
            return TokenOutput(toks, lps, reason, c.stop_reason)

        return await self._loop.run(run())

    def abort(self, request_id: str) -> None:
        """Abort a request (its ``generate`` returns the partial output)."""
        self._loop.call(self.engine.abort(request_id), timeout_s=60)

    def update_weights(self, weights: Iterable[WeightItem]) -> None:
        """Stream tensors to every worker in chunks of ``weight_chunk``."""
        chunk: list[WeightItem] = []
        for item in weights:
            chunk.append(item)
            if len(chunk) >= self.weight_chunk:
                self._loop.call(self.engine.collective_rpc("postrl_load_weights", args=(chunk,)))
                chunk = []
        if chunk:
            self._loop.call(self.engine.collective_rpc("postrl_load_weights", args=(chunk,)))
        self._loop.call(self.engine.reset_prefix_cache())

    def sleep(self) -> None:
        """vLLM sleep level 1 (offload weights, free KV cache)."""
        self._loop.call(self.engine.sleep(level=1))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore weights / KV cache (``tags`` ⊆ {"weights", "kv_cache"})."""
        self._loop.call(self.engine.wake_up(tags))
