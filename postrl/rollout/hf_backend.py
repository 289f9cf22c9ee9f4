"""The ``hf`` rollout backend: any ``AutoModelForCausalLM`` through batched ``generate``.

For architectures the native engine lacks. Requests arriving together are grouped by their
sampling settings and run as one left-padded ``generate`` call; log-probs follow the postrl
convention (``log_softmax(raw_logits / T)[token]``, fp32, untruncated), computed from
``output_logits``. Limitations (stated, not hidden): per-request seeds seed the torch RNG once
per batch (reproducible for the same batch, not batch-invariant); ``abort`` cancels requests
still waiting, a running batch finishes first; stop strings are applied after generation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from postrl.rollout.base import register_rollout_backend
from postrl.rollout.types import RolloutError, SamplingParams, TokenOutput, WeightItem

__all__ = ["HFBackend"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Req:
    rid: str
    prompt: list[int]
    sp: SamplingParams
    fut: asyncio.Future


@register_rollout_backend("hf", device="cpu|cuda")
class HFBackend:
    """Batched ``transformers.generate`` backend.

    Args:
        model_path: HF model directory.
        device, dtype: where and in which dtype to load the model.
        max_batch_size: most requests per ``generate`` call.
    """

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        max_batch_size: int = 128,
        **_: object,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dt).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.pad_id = (
            gc.pad_token_id
            if gc.pad_token_id is not None
            else (self.eos_ids[0] if self.eos_ids else 0)
        )
        self.weight_version = 0
        self._queue: list[_Req] = []
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="postrl-hf")
        self._task: asyncio.Task | None = None
        self._asleep = False

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Queue one request; requests queued in the same tick share a ``generate`` call."""
        if not prompt_ids:
            raise RolloutError(f"request {request_id!r}: prompt_ids is empty")
        loop = asyncio.get_running_loop()
        req = _Req(request_id, [int(t) for t in prompt_ids], sampling, loop.create_future())
        self._queue.append(req)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drive())
        return await req.fut

    def abort(self, request_id: str) -> None:
        """Cancel a waiting request (returns an empty "abort" output)."""
        self._aborts.add(request_id)

    def update_weights(self, weights: Iterable[WeightItem], version: int | None = None) -> None:
        """Copy HF-named tensors into the model's parameters/buffers."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with self._lock, torch.no_grad():
            for name, t in weights:
                if name not in params:
                    raise KeyError(f"update_weights: unknown parameter {name!r}")
                params[name].copy_(t)
        self.weight_version = self.weight_version + 1 if version is None else int(version)

    def sleep(self) -> None:
        """Offload the model to CPU (on accelerators); new requests wait until ``wake_up``."""
        self._asleep = True
        if self.device.type != "cpu":
            self.model.to("cpu")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Move the model back to its device and resume serving."""
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)  # let concurrently created requests join the batch
        while self._queue:
            while self._asleep:
                await asyncio.sleep(0.01)
            batch, self._queue = (
                self._queue[: self.max_batch_size],
                self._queue[self.max_batch_size :],
            )
            keep = []
            for r in batch:
                if r.rid in self._aborts:
                    self._aborts.discard(r.rid)
                    r.fut.set_result(TokenOutput([], [], "abort"))
                else:
                    keep.append(r)
            groups: dict[tuple, list[_Req]] = {}
            for r in keep:
                s = r.sp
                groups.setdefault(
                    (s.temperature, s.top_k, s.top_p, s.ignore_eos, s.stop_token_ids), []
                ).append(r)
            for reqs in groups.values():
                try:
                    outs = await loop.run_in_executor(self._executor, self._run, reqs)
                except Exception as e:
                    logger.exception("hf generate failed")
                    outs = [RolloutError(f"hf generate failed: {e!r}")] * len(reqs)
                for r, o in zip(reqs, outs, strict=True):
                    if not r.fut.done():
                        (r.fut.set_exception if isinstance(o, Exception) else r.fut.set_result)(o)

    def _run(self, reqs: list[_Req]) -> list[TokenOutput]:
        sp = reqs[0].sp
        stop_ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else self.eos_ids)
        L = max(len(r.prompt) for r in reqs)
        ids = torch.full((len(reqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, L - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, L - len(r.prompt) :] = 1
        max_new = max(r.sp.max_new_tokens for r in reqs)
        greedy = sp.temperature <= 0
        if sp.seed is not None:
            torch.manual_seed(sp.seed)
        kw = (
            dict(do_sample=False)
            if greedy
            else dict(
                do_sample=True,
                temperature=sp.temperature,
                top_k=sp.top_k if sp.top_k > 0 else 0,
                top_p=sp.top_p,
            )
        )
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_new,
                eos_token_id=stop_ids or None,
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
        gen = out.sequences[:, L:].cpu()  # (B, N)
        T = 1.0 if greedy else sp.temperature
        logits = torch.stack(out.logits, 1).float().cpu() / T  # (B, N, V)
        lps = torch.log_softmax(logits, -1).gather(2, gen[..., None]).squeeze(-1)
        return [
            self._trim(r, gen[i].tolist(), lps[i].tolist(), stop_ids) for i, r in enumerate(reqs)
        ]

    def _trim(self, r: _Req, toks: list[int], lps: list[float], stop_ids: list[int]) -> TokenOutput:
        n, reason, stop = min(len(toks), r.sp.max_new_tokens), "length", None
        for i, t in enumerate(toks[:n]):
            if t in stop_ids:
                n, reason, stop = i + 1, "stop", t
                break
        if r.sp.stop:
            for i in range(1, n + 1):
                text = self.tokenizer.decode(toks[:i])
                hit = next((s for s in r.sp.stop if s in text), None)
                if hit is not None:
                    n, reason, stop = i, "stop", hit
                    break
        return TokenOutput(
            toks[:n], lps[:n] if r.sp.logprobs else [], reason, stop, [(n, self.weight_version)]
        )
