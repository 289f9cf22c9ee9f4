"""``sglang`` rollout backend (GPU; ``pip install postrl[sglang]``).

Adapts ``sglang.Engine``: ``async_generate(input_ids=..., return_logprob=True)`` for generation
(sampled-token log-probs from ``meta_info["output_token_logprobs"]``),
``update_weights_from_tensor`` for the per-tensor stream, ``release_memory_occupation`` /
``resume_memory_occupation`` for sleep/wake and ``abort_request`` for aborts. Untested in CI.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from postrl.rollout.base import register_rollout_backend
from postrl.rollout.loop_thread import LoopThread
from postrl.rollout.types import SamplingParams, TokenOutput, WeightItem

__all__ = ["SGLangBackend"]


@register_rollout_backend("sglang", device="cuda")
class SGLangBackend:
    """SGLang offline ``Engine`` behind postrl's ``RolloutBackend`` interface.

    Args:
        model_path: HF model directory.
        engine_kwargs: forwarded to ``sglang.Engine`` (``tp_size``, ``mem_fraction_static``, ...).
        weight_chunk: tensors per ``update_weights_from_tensor`` call.
    """

    def __init__(self, model_path: str, weight_chunk: int = 64, **engine_kwargs: Any) -> None:
        try:
            import sglang
        except ImportError as e:
            raise ImportError(
                "rollout backend 'sglang' needs SGLang: "
                "install it with `pip install postrl[sglang]`"
            ) from e
        engine_kwargs.pop("device", None)
        engine_kwargs.setdefault("enable_memory_saver", True)
        self._loop = LoopThread("postrl-sglang")
        self.engine = sglang.Engine(
            model_path=model_path, skip_tokenizer_init=True, **engine_kwargs
        )
        self.weight_chunk = weight_chunk

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """See ``RolloutBackend.generate``."""
        params = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            stop=list(sampling.stop),
            ignore_eos=sampling.ignore_eos,
        )
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed

        async def run() -> TokenOutput:
            out = await self.engine.async_generate(
                input_ids=list(prompt_ids),
                sampling_params=params,
                return_logprob=sampling.logprobs,
                rid=request_id,
            )
            meta = out["meta_info"]
            toks = list(out["output_ids"])
            lps = (
                [float(x[0]) for x in meta.get("output_token_logprobs", [])]
                if sampling.logprobs
                else []
            )
            fr = meta.get("finish_reason") or {}
            kind = fr.get("type") if isinstance(fr, dict) else str(fr)
            reason = kind if kind in ("stop", "length") else "abort"
            return TokenOutput(
                toks, lps, reason, fr.get("matched") if isinstance(fr, dict) else None
            )

        return await self._loop.run(run())

    def abort(self, request_id: str) -> None:
        """Abort a request (partial output returned)."""
        self.engine.tokenizer_manager.abort_request(request_id)

    def update_weights(self, weights: Iterable[WeightItem]) -> None:
        """Stream tensors into the engine in chunks."""
        chunk: list[WeightItem] = []
        for item in weights:
            chunk.append(item)
            if len(chunk) >= self.weight_chunk:
                self.engine.update_weights_from_tensor(named_tensors=chunk)
                chunk = []
        if chunk:
            self.engine.update_weights_from_tensor(named_tensors=chunk)

    def sleep(self) -> None:
        """Release KV cache and weights (SGLang memory saver)."""
        self.engine.release_memory_occupation()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released."""
        self.engine.resume_memory_occupation(
            tags=tags
        ) if tags else self.engine.resume_memory_occupation()
