"""The ``native`` rollout backend: continuous batching over a slot KV cache.

One engine step (run in a single worker thread so the event loop stays responsive):

1. apply pending aborts;
2. if requests wait and slots are free: **admit** them — identical prompts among the admitted
   requests are prefilled *once* and their K/V copied into each of their slots (the n samples
   of a GRPO prompt arrive together), then every new slot samples its first token;
3. otherwise **decode**: one batched forward over the running slots ``0..B-1`` and batched
   sampling (``sampler.sample_tokens``);
4. finished rows (stop id, stop string, length, abort) resolve their futures and leave; the last
   running slots move into the holes so the running set stays a prefix of the cache.

Requests join and leave at every step. All per-sequence state lives in tensors indexed by slot;
Python touches individual requests only at admission, finish, and for requests with stop strings.

Weight swaps without aborts (``begin_weight_swap`` … ``update_weights`` … ``end_weight_swap``):
while a swap is open no step runs (running requests keep their slots and K/V, new ones queue);
closing it bumps ``weight_version``, records a version boundary in every running request (its
``TokenOutput.versions`` become ``[(n_0, v_0), (n_1, v_1), ...]``) and, with
``swap_kv="recompute"``, re-computes every live K/V under the new weights (every prefix row
re-prefilled; every slot's generated tokens replayed through the decode path, one batched decode
per position) so the tokens sampled after the swap have the log-probs of a teacher-forced forward
of the new weights over the whole sequence.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from os.path import commonprefix  # element-wise: token tuples too

import torch

from postrl.rollout.base import register_rollout_backend
from postrl.rollout.native import kernels as _kernels
from postrl.rollout.native.forward import decode, decode_fused, prefill, prefill_fused
from postrl.rollout.native.kvstore import DecodeLayout, KVStore
from postrl.rollout.native.model import load_config, load_weights, rope_tables
from postrl.rollout.native.sampler import sample_tokens
from postrl.rollout.types import RolloutError, SamplingParams, TokenOutput, WeightItem

__all__ = ["NativeBackend"]

logger = logging.getLogger(__name__)
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_MAX_STOP = 8
_MIN_TRUNK = 8  # shortest shared prefix worth a copy (see NativeBackend._shared_lengths)
_SWAP_KV = ("recompute", "keep")


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    seed: int
    stop_ids: list[int] = field(default_factory=list)
    bounds: list[tuple[int, int]] = field(default_factory=list)
    """Version boundaries ``(tokens generated at the swap, version that sampled them)``."""
    cont: list[int] = field(default_factory=list)
    """A continuation's earlier output (``SamplingParams.continued``): ``prompt`` is the shared
    part, these ids are replayed into the slot and left out of the output."""


@register_rollout_backend("native", device="cpu|cuda")
class NativeBackend:
    """Native continuous-batching engine for Qwen2 / Llama / Qwen3 checkpoints.

    Args:
        model_path: HF model directory (config.json + *.safetensors).
        max_num_seqs: KV-cache slots = maximum concurrently running sequences.
        max_model_len: maximum prompt + completion length per sequence.
        device: "cpu" or "cuda[:i]".
        dtype: parameter / activation dtype ("float32", "bfloat16", "float16" or a torch.dtype).
        max_num_batched_tokens: token budget of one prefill forward (padded unique prompts).
        seed: seeds the draw of per-request seeds for requests with ``seed=None``.
        threaded: run engine steps in a worker thread (the event loop stays responsive during a
            step). Default False: steps run inline in the event loop, yielding between steps —
            measured 1.7× faster on CPU, because torch's OpenMP (libgomp) throttles its worker
            spin-wait once a second thread team exists, so every op from a non-main thread pays
            a wake-up.
        kernels: decode implementation. ``"auto"`` (default): the fused C kernels
            (``kernels.py``: RMSNorm, RoPE + cache write, attention) when the model runs in fp32
            on CPU and a C compiler is available, else the torch ops; ``"fused"``: require them
            (error naming the reason otherwise); ``"torch"``: torch ops only.
        share_prefix: prefill the longest prefix shared by the prompts (a chat template's
            opening, a system prompt, a tool schema) once per weight version and copy its K/V
            into each new prompt's row, so only each prompt's own tail is prefilled (the
            *trunk*, below). With the fused kernels only; the torch path prefills whole prompts.
            Default True.
        swap_kv: what ``end_weight_swap`` does with the K/V of running requests.
            ``"recompute"`` (default): re-prefill every live prompt and replay every slot's
            generated tokens under the new weights, so every token sampled after the swap has
            exactly (up to float rounding) the log-prob a teacher-forced forward of the new
            weights gives over the whole sequence. ``"keep"``: no recompute (the swap costs only
            the copy); tokens sampled after it attend K/V computed by the old weights, so their
            log-probs come from a mixed old/new forward that no trainer-side forward reproduces
            (stored prompt logits are stale too: a request joining a live prompt after the swap
            samples its first token from the old weights). Versions are tagged the same way in
            both modes.
    """

    def __init__(
        self,
        model_path: str,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        max_num_batched_tokens: int = 2048,
        seed: int = 0,
        threaded: bool = False,
        kernels: str = "auto",
        swap_kv: str = "recompute",
        share_prefix: bool = True,
    ) -> None:
        if swap_kv not in _SWAP_KV:
            raise ValueError(f"swap_kv={swap_kv!r} is not one of {_SWAP_KV}")
        self.swap_kv = swap_kv
        self.model_path = str(model_path)
        self.cfg = load_config(model_path)
        if isinstance(dtype, str) and dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} unsupported; choose one of {sorted(_DTYPES)}")
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.device = torch.device(device)
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len or min(self.cfg.max_position_embeddings, 2048))
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.weights = load_weights(model_path, self.cfg, self.dtype, self.device)
        self.kernels = _load_kernels(kernels, self.cfg.head_dim, self.dtype, self.device)
        self.kernels_step = (
            self.kernels is not None
        )  # whole-step C decode (per-op kernels if unavailable)
        self._step_fn: _kernels.DecodeStep | None = None
        self.share_prefix = bool(share_prefix) and self.kernels is not None
        self._trunk: tuple[int, ...] = ()  # the shared prompt prefix (see _prefill)
        self._trunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # its K/V, these weights
        self.prefill_tokens = 0
        """Prompt positions prefilled so far (rows × their length, padding excluded)."""
        self.prefill_tokens_shared = 0
        """Of the prompt positions admitted, those copied from the trunk instead."""
        self._sample_scratch = torch.empty(0)  # C sampler workspace (B, V), reused across steps
        self.cos, self.sin = rope_tables(self.cfg, self.max_model_len, self.dtype, self.device)
        half = self.cfg.head_dim // 2
        self.sin_signed = torch.cat(
            [-self.sin[:, :half], self.sin[:, half:]], dim=-1
        )  # for apply_rope_fast
        self.weight_version = 0
        self.busy_s = 0.0
        """Seconds spent in engine steps so far (idle fraction = 1 − Δbusy_s / Δwall)."""
        self._rng = random.Random(seed)
        self._stop_ids: dict[tuple[tuple[int, ...], bool], list[int]] = {}
        self._lock = threading.RLock()  # guards engine state (step / update / sleep)
        self._qlock = threading.Lock()  # guards _waiting and _aborts
        self._waiting: deque[_Request] = deque()
        self._aborts: set[str] = set()
        self._slots: list[_Request] = []  # running requests; slot i = self._slots[i]
        self._threaded = threaded
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="postrl-native")
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asleep = False
        self._held = False  # a weight swap is open: no step runs (guarded by _qlock)
        self._held_since = 0.0
        self._held_waiters: list[asyncio.Future] = []  # _drive loops parked until the swap ends
        self._weights_backup: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._tokenizer = None
        self._alloc_state()

    # ------------------------------------------------------------------ state
    def _alloc_state(self) -> None:
        S, T, dev = self.max_num_seqs, self.max_model_len, self.device
        with torch.inference_mode():
            self.kv: KVStore | None = self._new_kv()
            i64 = dict(dtype=torch.int64, device=dev)
            self.s_last = torch.zeros(S, **i64)  # last sampled token (next decode input)
            self.s_pos = torch.zeros(S, **i64)  # position the last token will be written at
            self.s_ngen = torch.zeros(S, **i64)
            self.s_maxnew = torch.zeros(S, **i64)
            self.s_seed = torch.zeros(S, **i64)
            self.s_topk = torch.zeros(S, **i64)
            self.s_temp = torch.zeros(S, dtype=torch.float32, device=dev)
            self.s_topp = torch.ones(S, dtype=torch.float32, device=dev)
            self.s_plen = torch.zeros(S, **i64)  # prompt length
            self.s_pid = torch.zeros(S, **i64)  # prefix row in the KV store
            self.s_stop = torch.full((S, _MAX_STOP), -1, **i64)
            self.s_out = torch.zeros(S, T, **i64)
            self.s_logp = torch.zeros(S, T, dtype=torch.float32, device=dev)
            self._ar_s = torch.arange(S, **i64)
            self._ar_t = torch.arange(T, **i64)
        self._state_tensors = [
            self.s_last,
            self.s_pos,
            self.s_ngen,
            self.s_maxnew,
            self.s_seed,
            self.s_topk,
            self.s_temp,
            self.s_topp,
            self.s_plen,
            self.s_pid,
            self.s_stop,
            self.s_out,
            self.s_logp,
        ]
        self._layout: DecodeLayout | None = None
        self._use_filters = self._any_stop_str = False
        self._admitting: list[_Request] = []

    def _new_kv(self) -> KVStore:
        c = self.cfg
        return KVStore(
            c.num_layers,
            self.max_num_seqs,
            c.num_kv_heads,
            self.max_model_len,
            c.head_dim,
            c.vocab_size,
            self.dtype,
            self.device,
        )

    # ------------------------------------------------------------------ public API
    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str
    ) -> TokenOutput:
        """Queue one request and await its completion (see ``RolloutBackend.generate``)."""
        prompt = list(map(int, prompt_ids))
        if not prompt:
            raise RolloutError(
                f"request {request_id!r}: prompt_ids is empty; pass at least one token"
            )
        if len(prompt) >= self.max_model_len:
            raise RolloutError(
                f"request {request_id!r}: prompt has {len(prompt)} tokens but "
                f"max_model_len={self.max_model_len}; "
                f"shorten the prompt or raise max_model_len"
            )
        if max(prompt) >= self.cfg.vocab_size or min(prompt) < 0:
            raise RolloutError(
                f"request {request_id!r}: token id out of range [0, {self.cfg.vocab_size})"
            )
        stop_key = (sampling.stop_token_ids, sampling.ignore_eos)
        stop_ids = self._stop_ids.get(stop_key)
        if stop_ids is None:  # one list per distinct setting (the requests of a run share one)
            stop_ids = list(
                dict.fromkeys(
                    list(sampling.stop_token_ids)
                    + ([] if sampling.ignore_eos else list(self.cfg.eos_token_ids))
                )
            )
            if len(self._stop_ids) < 64:
                self._stop_ids[stop_key] = stop_ids
        if len(stop_ids) > _MAX_STOP:
            raise RolloutError(
                f"request {request_id!r}: at most {_MAX_STOP} stop token ids (got {len(stop_ids)})"
            )
        loop = asyncio.get_running_loop()
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(62)
        c = min(sampling.continued, len(prompt) - 1)  # at least one shared prompt id
        req = _Request(
            request_id,
            prompt[: len(prompt) - c],
            sampling,
            loop.create_future(),
            loop,
            int(seed),
            stop_ids,
            cont=prompt[len(prompt) - c :],
        )
        with self._qlock:
            self._enqueue(req)
        self._ensure_running(loop)
        return await req.future

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` at the next step; its ``generate`` returns the partial output."""
        with self._qlock:
            self._aborts.add(request_id)
        self._kick()

    def update_weights(self, weights: Iterable[WeightItem], version: int | None = None) -> None:
        """Copy a per-tensor stream of HF-named tensors into the engine's (fused) parameters.

        Inside an open swap (``begin_weight_swap``) it only copies; ``version`` is then ignored
        (``end_weight_swap`` sets it). Outside one it is itself an atomic swap: begin, copy,
        ``end_weight_swap(version)`` (default version: increment). Running requests are never
        aborted. Unknown names raise (rotary ``inv_freq`` buffers are ignored); a stream that
        raises part-way closes its own swap without changing the version (the weights copied so
        far stay).
        """
        with self._lock:
            own = not self._held
            if own:
                self.begin_weight_swap()
        try:
            n = self._copy_weights(weights)
        except BaseException:
            if own:
                self.end_weight_swap(self.weight_version)
            raise
        if own:
            self.end_weight_swap(version)
        logger.debug("native: copied %d tensors", n)

    def _copy_weights(self, weights: Iterable[WeightItem]) -> int:
        """Copy ``(name, tensor)`` items into the parameter views; returns the number copied."""
        views = self.weights.views
        n = 0
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                dst = views.get(name)
                if dst is None:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise KeyError(
                        f"update_weights: unknown parameter {name!r} (expected HF names such as "
                        f"{next(iter(views))!r})"
                    )
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                        f"engine expects {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
                n += 1
            if n:
                self._trunk_kv = None  # computed by the old weights: recomputed on next use
        return n

    def begin_weight_swap(self) -> None:
        """Hold the engine for a weight update: after this returns no step runs (an in-flight
        threaded step is waited for) until ``end_weight_swap``. Running requests keep their slots
        and K/V, new requests queue, nothing is aborted. Raises if a swap is already open."""
        with self._lock, self._qlock:
            if self._held:
                raise RuntimeError(
                    "begin_weight_swap: a weight swap is already open; call end_weight_swap first"
                )
            self._held = True
            self._held_since = time.perf_counter()

    @property
    def weight_swap_open(self) -> bool:
        """True between ``begin_weight_swap`` and ``end_weight_swap``."""
        return self._held

    def end_weight_swap(self, version: int | None = None) -> dict[str, float]:
        """Close the swap opened by ``begin_weight_swap`` and let the engine step again.

        Aborts requested while held are applied first (those requests end on the old version).
        Then every running request gets a version boundary (its tokens so far were sampled by the
        old ``weight_version``), ``weight_version`` becomes ``version`` (default: old + 1) and,
        with ``swap_kv="recompute"``, every live K/V is recomputed under the new weights
        (``_recompute_kv``).

        Returns:
            ``{"pause_s": seconds the engine was held (recompute included), "recompute_s":
            seconds of the K/V recompute, "running": requests carried over the swap}``.
        """
        with self._lock, torch.inference_mode():
            if not self._held:
                raise RuntimeError("end_weight_swap: no weight swap is open (begin_weight_swap)")
            try:
                done = self._finish_and_compact(self._collect_aborts())
                old = self.weight_version
                new = old + 1 if version is None else int(version)
                B = len(self._slots)
                if B and new != old:
                    for req, n in zip(self._slots, self.s_ngen[:B].tolist(), strict=True):
                        req.bounds.append((n - len(req.cont), old))
                t0 = time.perf_counter()
                if self.swap_kv == "recompute" and self.kv is not None:
                    self._recompute_kv()
                t1 = time.perf_counter()
                held_s = t1 - self._held_since
                self.weight_version = new
            finally:
                self._release_hold()
        for req, out in done:
            _resolve(req, out)
        self._kick()
        logger.debug("native: weight swap to version %d (%d running)", new, B)
        return {"pause_s": held_s, "recompute_s": t1 - t0, "running": float(B)}

    def _release_hold(self) -> None:
        """Clear the swap flag and wake every ``_drive`` loop parked on it."""
        with self._qlock:
            self._held = False
            waiters, self._held_waiters = self._held_waiters, []
        for fut in waiters:
            loop = fut.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_res, fut, None)

    def _hold_waiter(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future | None:
        """A future resolved when the open swap ends (None when no swap is open)."""
        with self._qlock:
            if not self._held:
                return None
            fut = loop.create_future()
            self._held_waiters.append(fut)
            return fut

    def _recompute_kv(self) -> None:
        """Recompute all live K/V under the current weights, leaving every slot's sampling state
        (``s_out``, ``s_logp``, ``s_ngen``, ``s_last``, ``s_pos``, seeds) untouched.

        Prefix rows are re-prefilled (their K/V and stored last-position logits). Slot ``i``
        (prompt length ``L_i``, ``n_i`` generated tokens ``g_0 .. g_{n_i-1}``) holds K/V at
        positions ``L_i .. L_i + n_i - 2`` (fed ``g_0 .. g_{n_i-2}``; ``g_{n_i-1}`` is the next
        decode input at ``s_pos``). Replay step ``j = 0 .. max(n) - 2`` is one batched decode over
        all running slots feeding ``g_{c}`` at position ``L_i + c``, ``c = clamp(min(j, n_i - 2),
        0)``: position order makes each step attend already-recomputed K/V; a slot that finished
        replaying re-writes its last position with the same values (idempotent); a slot with
        ``n_i = 1`` writes position ``s_pos`` with ``s_last``, which the next decode overwrites
        with the same values. The logits are discarded.
        """
        kv = self.kv
        if kv.num_prefixes:
            self._prefill(list(range(kv.num_prefixes)))
        B = len(self._slots)
        if not B:
            return
        ngen = self.s_ngen[:B]
        last = (ngen - 2).clamp_(min=0)  # (B,) index of the last generated token to replay
        out, plen = self.s_out[:B], self.s_plen[:B]
        for j in range(int(ngen.max()) - 1):
            c = last.clamp(max=j)  # (B,)
            tok = out.gather(1, c[:, None]).squeeze(1).contiguous()  # (B,)
            self._forward_decode(tok, (plen + c).contiguous())

    def sleep(self) -> None:
        """Abort running requests and release the KV cache; on accelerators also offload weights.

        Requests submitted while asleep wait until ``wake_up``.
        """
        with self._lock:
            if self._asleep:
                return
            with self._qlock:
                self._aborts.update(r.request_id for r in self._slots)
            if self._slots:
                for req, out in self._finish_and_compact(self._collect_aborts()):
                    _resolve(req, out)
            self.kv = None
            self._step_fn = None  # it points into the released store
            if self.device.type != "cpu":
                self._weights_backup = []
                for t in self._base_weights():
                    self._weights_backup.append((t, t.detach().to("cpu")))
                    t.untyped_storage().resize_(0)
            self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate the KV cache and restore offloaded weights (``tags`` accepted for API parity;
        the native engine restores both)."""
        with self._lock:
            if not self._asleep:
                return
            if self._weights_backup is not None:
                for t, cpu in self._weights_backup:
                    t.untyped_storage().resize_(cpu.numel() * cpu.element_size())
                    t.copy_(cpu)
                self._weights_backup = None
            with torch.inference_mode():
                self.kv = self._new_kv()
            self._asleep = False
        self._kick()

    @property
    def num_running(self) -> int:
        """Requests currently holding a slot."""
        return len(self._slots)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

    def close(self) -> None:
        """Shut down the worker thread (pending requests are aborted)."""
        with self._qlock:
            self._aborts.update(r.request_id for r in self._waiting)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ driver
    def _base_weights(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for v in self.weights.views.values():
            base = v._base if v._base is not None else v
            if id(base) not in seen:
                seen.add(id(base))
                out.append(base)
        return out

    def _has_work(self) -> bool:
        return bool(self._slots) or bool(self._aborts) or (bool(self._waiting) and not self._asleep)

    def _ensure_running(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._task = loop.create_task(self._drive())

    def _kick(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed() and self._has_work():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._ensure_running(loop)
            else:
                loop.call_soon_threadsafe(self._ensure_running, loop)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self._has_work():
            held = self._hold_waiter(loop)
            if held is not None:  # a weight swap is open: park until end_weight_swap
                await held
                continue
            try:
                t0 = time.perf_counter()
                if self._threaded:
                    done = await loop.run_in_executor(self._executor, self._step)
                else:
                    done = self._step()
                self.busy_s += time.perf_counter() - t0
                if not self._threaded:
                    await asyncio.sleep(0)
            except Exception as e:  # fail every request rather than hang callers
                logger.exception("native engine step failed")
                self._fail_all(RolloutError(f"native engine step failed: {e!r}"))
                return
            for req, out in done:
                _resolve(req, out)

    def _fail_all(self, err: Exception) -> None:
        with self._lock, self._qlock:
            reqs = list(self._slots) + list(self._waiting) + self._admitting
            self._slots.clear()
            self._waiting.clear()
            self._admitting = []
            if self.kv is not None:  # drop prefix refcounts held by the failed requests
                with torch.inference_mode():
                    self.kv = self._new_kv()
                self._step_fn = None
            self._membership_changed()
        for r in reqs:
            if not r.future.done():
                r.loop.call_soon_threadsafe(_set_exc, r.future, err)

    # ------------------------------------------------------------------ one step
    def _step(self) -> list[tuple[_Request, TokenOutput]]:
        with self._lock, torch.inference_mode():
            finished: list[tuple[_Request, TokenOutput]] = []
            if self._held:  # a weight swap opened after _drive checked: step nothing
                return finished
            aborted = self._collect_aborts()  # slot indices + already-resolved waiting requests
            if aborted[0] or aborted[1]:
                finished += self._finish_and_compact(aborted)
            if self._asleep:
                return finished
            free = self.max_num_seqs - len(self._slots)
            with self._qlock:
                new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            if new:
                self._admitting = new  # failed by _fail_all if admission raises
                rows = self._admit(new)
                self._admitting = []
            elif self._slots:
                rows = self._decode()
            else:
                return finished
            done = self._done_rows(rows)
            if done:
                finished += self._finish_and_compact((done, []))
            return finished

    def _enqueue(self, req: _Request) -> None:
        """Insert by ``sampling.priority`` (lower first), FIFO within a priority; O(1) when all
        requests share one priority (the synchronous case)."""
        w, p = self._waiting, req.sampling.priority
        if not w or w[-1].sampling.priority <= p:
            w.append(req)
            return
        i = len(w)
        while i > 0 and w[i - 1].sampling.priority > p:
            i -= 1
        w.insert(i, req)

    def _collect_aborts(self) -> tuple[list[tuple[int, str]], list[tuple[_Request, TokenOutput]]]:
        with self._qlock:
            ids, self._aborts = self._aborts, set()
            if not ids:
                return [], []
            waiting_hit = [r for r in self._waiting if r.request_id in ids]
            for r in waiting_hit:
                self._waiting.remove(r)
        slots = [(i, "abort") for i, r in enumerate(self._slots) if r.request_id in ids]
        return slots, [(r, TokenOutput([], [], "abort")) for r in waiting_hit]

    def _admit(self, new: list[_Request]) -> slice:
        """Give ``new`` requests slots ``B .. B+n-1``; prefill each distinct, not-yet-live prompt
        once; sample every new slot's first token. Returns the new slot indices."""
        B, n, dev, kv = len(self._slots), len(new), self.device, self.kv
        pids, fresh = kv.lookup([tuple(r.prompt) for r in new])
        # fresh requests first, then continuations; the samples of a prompt contiguous
        order_new = sorted(range(n), key=lambda i: (bool(new[i].cont), pids[i]))
        new, pids = [new[i] for i in order_new], [pids[i] for i in order_new]
        nf = sum(1 for r in new if not r.cont)
        self._prefill(fresh)
        sp = [r.sampling for r in new]
        plen = torch.tensor([len(r.prompt) for r in new], device=dev)
        ncont = torch.tensor([len(r.cont) for r in new], device=dev)
        self.s_pos[B : B + n] = plen + (ncont - 1).clamp_(min=0)
        self.s_plen[B : B + n] = plen
        self.s_pid[B : B + n] = torch.tensor(pids, device=dev)
        self.s_ngen[B : B + n] = ncont
        self.s_maxnew[B : B + n] = torch.tensor([s.max_new_tokens for s in sp], device=dev) + ncont
        self.s_seed[B : B + n] = torch.tensor([r.seed for r in new], device=dev)
        self.s_topk[B : B + n] = torch.tensor([s.top_k for s in sp], device=dev)
        self.s_temp[B : B + n] = torch.tensor([s.temperature for s in sp], device=dev)
        self.s_topp[B : B + n] = torch.tensor([s.top_p for s in sp], device=dev)
        stop = [r.stop_ids + [-1] * (_MAX_STOP - len(r.stop_ids)) for r in new]
        self.s_stop[B : B + n] = torch.tensor(stop, dtype=torch.int64, device=dev)
        self._slots.extend(new)
        self._membership_changed()
        if nf < n:
            self._admit_continued(B + nf, new[nf:])
        rows = slice(B, B + nf)
        if nf:
            self._sample(rows, kv.logits[torch.tensor(pids[:nf], device=dev)], advance_pos=False)
        return rows

    def _admit_continued(self, start: int, reqs: list[_Request]) -> None:
        """Slots ``start ..`` continue ``reqs`` (``cont`` = their earlier output): the ids go
        into ``s_out`` (their log-probs are not returned), the last one becomes the next decode
        input at ``s_pos``, and the K/V of the others is written by replaying them through the
        batched decode — one step per position, over all running slots: the other slots re-feed
        their next input at ``s_pos``, which their next decode overwrites with the same values
        (as ``_recompute_kv``). A continuation of one id needs no replay at all."""
        dev, n = self.device, len(reqs)
        cmax = max(len(r.cont) for r in reqs)
        out = torch.zeros(n, cmax, dtype=torch.int64)
        for i, r in enumerate(reqs):
            out[i, : len(r.cont)] = torch.tensor(r.cont, dtype=torch.int64)
        rows = slice(start, start + n)
        self.s_out[rows, :cmax] = out.to(dev)
        self.s_logp[rows, :cmax] = 0.0
        self.s_last[rows] = self.s_out[rows].gather(1, (self.s_ngen[rows] - 1)[:, None])[:, 0]
        if cmax < 2:
            return
        B = len(self._slots)
        last = (self.s_ngen[:B] - 2).clamp(min=0)  # last continued id to replay, per slot
        for j in range(cmax - 1):
            c = last[rows].clamp(max=j)
            tok, pos = self.s_last[:B].clone(), self.s_pos[:B].clone()
            tok[rows] = self.s_out[rows].gather(1, c[:, None])[:, 0]
            pos[rows] = self.s_plen[rows] + c
            self._forward_decode(tok.contiguous(), pos.contiguous())

    def _prefill(self, rows: list[int]) -> None:
        """Prefill prefix rows ``rows`` of the KV store (their prompts ``kv.keys[r]``): K/V into
        ``kv.pk``/``kv.pv`` and last-position logits into ``kv.logits``, in chunks of similar
        length padded under ``max_num_batched_tokens``.

        With ``share_prefix`` a row whose prompt starts with the trunk — the prefix the prompts
        admitted so far share — gets the trunk's K/V copied in and prefills only the rest
        (``_shared_lengths``). Each position's K/V is the same function of the same tokens
        either way: the trunk's K/V come from a prefill of the trunk itself, once per weight
        version."""
        if not rows:  # every admitted prompt is live already
            return
        kv = self.kv
        prompts = [kv.keys[r] for r in rows]
        shared = self._shared_lengths(prompts, rows[0]) if self.share_prefix else [0] * len(rows)
        self.prefill_tokens += sum(len(p) - c for p, c in zip(prompts, shared, strict=True))
        self.prefill_tokens_shared += sum(shared)
        # chunk by shared length, then by length under the budget
        order = sorted(range(len(rows)), key=lambda i: (shared[i], len(prompts[i])))
        start = 0
        while start < len(order):
            c0 = shared[order[start]]
            end = start + 1
            while (
                end < len(order)
                and shared[order[end]] == c0
                and (end - start + 1) * (len(prompts[order[end]]) - c0)
                <= self.max_num_batched_tokens
            ):
                end += 1
            chunk = order[start:end]
            self._prefill_chunk([rows[i] for i in chunk], [prompts[i] for i in chunk], c0)
            start = end

    def _prefill_chunk(self, rows: list[int], prompts: list[tuple[int, ...]], c: int) -> None:
        """One padded prefill forward of ``prompts`` into prefix rows ``rows``, all of whose
        first ``c`` positions are the trunk's (copied in first, not computed)."""
        kv, dev = self.kv, self.device
        rows_t = torch.tensor(rows, device=dev)
        if c:
            tk, tv = self._trunk_kv
            kv.pk[:, rows_t, :, :c] = tk[:, None, :, :c]
            kv.pv[:, rows_t, :, :c] = tv[:, None, :, :c]
        P = max(len(p) for p in prompts) - c
        toks = torch.zeros(len(rows), P, dtype=torch.int64)
        for j, p in enumerate(prompts):
            toks[j, : len(p) - c] = torch.tensor(p[c:])
        lens = torch.tensor([len(p) - c for p in prompts], device=dev)
        if self.kernels is not None:
            kv.logits[rows_t] = prefill_fused(
                self.weights,
                self.cfg,
                self.kernels,
                toks.to(dev),
                lens,
                self.cos,
                self.sin,
                kv.pk,
                kv.pv,
                rows_t,
                c,
            )
        else:
            kv.logits[rows_t] = prefill(
                self.weights,
                self.cfg,
                toks.to(dev),
                lens,
                self.cos,
                self.sin_signed,
                kv.pk,
                kv.pv,
                rows_t,
            )

    def _shared_lengths(self, prompts: list[tuple[int, ...]], scratch: int) -> list[int]:
        """How many leading positions of each prompt to copy from the trunk (0: prefill it all).

        The trunk is a token prefix; a prompt shares ``min(LCP(prompt, trunk), len − 1)`` of it
        (its last position is always computed: its logits sample the first token). The trunk
        shrinks to what every prompt of this call shares while that is at least ``_MIN_TRUNK``
        positions; when no prompt of a call shares that much, or there is none yet, it is set to
        these prompts' common prefix, short of the shortest one's last position. Its K/V are
        computed by prefilling the trunk alone into row ``scratch`` (one this call prefills
        next) — once per weight version (``_copy_weights`` drops them) — and kept apart from the
        store, so prefix rows come and go without touching it.
        """
        share = [min(len(commonprefix([p, self._trunk])), len(p) - 1) for p in prompts]
        if max(share, default=0) < _MIN_TRUNK:  # none yet, or another family: start from these
            self._trunk = commonprefix(prompts)[: min(len(p) for p in prompts) - 1]
            self._trunk_kv = None
            share = [len(self._trunk)] * len(prompts)
        elif min(share) >= _MIN_TRUNK and min(share) < len(self._trunk):
            self._trunk = self._trunk[: min(share)]  # its K/V's first positions stay valid
        c = len(self._trunk)
        if c < _MIN_TRUNK:
            self._trunk, self._trunk_kv = (), None
            return [0] * len(prompts)
        # a prompt may share more with the trunk before it was cut than the trunk now holds
        share = [min(s, c) if s >= _MIN_TRUNK else 0 for s in share]
        if self._trunk_kv is None:
            # the trunk alone, prefilled into a row this call rewrites after; its K/V copied out
            self._prefill_chunk([scratch], [self._trunk], 0)
            self.prefill_tokens += c
            kv = self.kv
            self._trunk_kv = (kv.pk[:, scratch, :, :c].clone(), kv.pv[:, scratch, :, :c].clone())
        return share

    def _decode(self) -> slice:
        B = len(self._slots)
        logits = self._forward_decode(self.s_last[:B], self.s_pos[:B])
        rows = slice(0, B)
        self._sample(rows, logits, advance_pos=True)
        return rows

    def _forward_decode(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One batched decode forward over running slots ``0 .. B-1``: feed ``tokens`` (B,) at
        absolute positions ``pos`` (B,) (contiguous int64), write their K/V into the slot store,
        return logits (B, V). Uses the engine's decode implementation (whole-step C, fused op by
        op, or torch ops)."""
        B = tokens.shape[0]
        plen, pid = self.s_plen[:B], self.s_pid[:B]
        step = self._decode_step()
        if step is not None:  # the whole step in one C call
            return step(
                tokens, pos, plen, pid, self._ar_s[:B], self.cos, self.sin, torch.get_num_threads()
            )
        if self.kernels is not None:  # the same kernels op by op
            return decode_fused(
                self.weights,
                self.cfg,
                self.kernels,
                tokens,
                pos,
                plen,
                pid,
                self.cos,
                self.sin,
                self.kv,
                self._ar_s,
                torch.get_num_threads(),
            )
        off = pos - plen
        lo, hi = torch.stack([off.min(), off.max()]).tolist()
        if self._layout is None:
            self._layout = self.kv.layout(pid, plen)
        return decode(
            self.weights,
            self.cfg,
            tokens,
            pos,
            off,
            hi + 1,
            lo == hi,
            self.cos,
            self.sin_signed,
            self.kv,
            self._layout,
            self._ar_s,
            self._ar_t,
        )

    def _decode_step(self) -> _kernels.DecodeStep | None:
        """The whole-step C decoder for the current KV store (rebuilt after ``wake_up``)."""
        if self.kernels is None or not self.kernels_step:
            return None
        if self._step_fn is None or self._step_fn.kv is not self.kv:
            self._step_fn = self.kernels.decode_step(
                self.weights, self.cfg, self.kv, self.max_num_seqs
            )
            if self._step_fn is None:
                self.kernels_step = False
        return self._step_fn if self.kernels_step else None

    def _sample(self, rows: slice, logits: torch.Tensor, advance_pos: bool) -> None:
        """Sample one token for the contiguous slot range ``rows`` and record it (views only)."""
        ngen = self.s_ngen[rows]
        if self.kernels is not None and not self._use_filters and logits.dtype == torch.float32:
            B, V = logits.shape
            if self._sample_scratch.numel() < B * V:  # grown once to the largest batch, then reused
                self._sample_scratch = torch.empty(B * V, dtype=torch.float32)
            tok, lp = self.kernels.sample(
                logits.contiguous(),
                self.s_temp[rows],
                self.s_seed[rows],
                ngen,
                self._sample_scratch[: B * V].view(B, V),
            )
        else:
            tok, lp = sample_tokens(
                logits,
                self.s_temp[rows],
                self.s_topk[rows],
                self.s_topp[rows],
                self.s_seed[rows],
                ngen,
                self._use_filters,
            )
        idx = ngen[:, None]
        self.s_out[rows].scatter_(1, idx, tok[:, None])
        self.s_logp[rows].scatter_(1, idx, lp[:, None].to(self.s_logp.dtype))
        ngen += 1  # in-place on the view
        self.s_last[rows] = tok
        if advance_pos:
            self.s_pos[rows] += 1

    def _done_rows(self, rows: slice) -> list[tuple[int, str]]:
        hit_stop = (self.s_stop[rows] == self.s_last[rows, None]).any(-1)
        hit_len = (self.s_ngen[rows] >= self.s_maxnew[rows]) | (
            self.s_pos[rows] >= self.max_model_len - 1
        )
        flags = (hit_stop.to(torch.int8) * 2 + hit_len.to(torch.int8)).tolist()
        base = rows.start
        out = [(base + i, "stop" if f >= 2 else "length") for i, f in enumerate(flags) if f]
        if self._any_stop_str:
            taken = {i for i, _ in out}
            for i in range(base, base + len(flags)):
                if (
                    i not in taken
                    and self._slots[i].sampling.stop
                    and self._stop_string(i) is not None
                ):
                    out.append((i, "stop_str"))
        return out

    def _membership_changed(self) -> None:
        """Refresh per-batch flags (on join/leave only, never per decode step)."""
        self._layout = None
        self._use_filters = any(r.sampling.top_k > 0 or r.sampling.top_p < 1 for r in self._slots)
        self._any_stop_str = any(r.sampling.stop for r in self._slots)

    def _stop_string(self, slot: int) -> str | None:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        n = int(self.s_ngen[slot])
        text = self._tokenizer.decode(self.s_out[slot, :n].tolist())
        return next((s for s in self._slots[slot].sampling.stop if s in text), None)

    def _segments(self, req: _Request, n: int) -> list[tuple[int, int]]:
        """``(num_tokens, version)`` segments of ``req``'s ``n`` tokens (sum ``n``; one segment
        ``[(n, weight_version)]`` when no swap happened while it ran)."""
        segs: list[tuple[int, int]] = []
        prev = 0
        for cut, v in [*req.bounds, (n, self.weight_version)]:
            if cut > prev:
                if segs and segs[-1][1] == v:
                    segs[-1] = (segs[-1][0] + cut - prev, v)
                else:
                    segs.append((cut - prev, v))
                prev = cut
        return segs or [(n, self.weight_version)]

    def _finish_and_compact(self, aborted) -> list[tuple[_Request, TokenOutput]]:
        done_slots, waiting_outs = aborted
        results = list(waiting_outs)
        if not done_slots:
            return results
        ngen = self.s_ngen.tolist()
        for i, why in done_slots:
            req, c = self._slots[i], len(self._slots[i].cont)
            n = ngen[i] - c
            toks = self.s_out[i, c : c + n].tolist()
            lps = self.s_logp[i, c : c + n].tolist() if req.sampling.logprobs else []
            if why == "stop":
                reason, stop_reason = "stop", toks[-1]
            elif why == "stop_str":
                reason, stop_reason = "stop", self._stop_string(i)
            else:
                reason, stop_reason = why, None
            results.append(
                (req, TokenOutput(toks, lps, reason, stop_reason, self._segments(req, n)))
            )
        gone = {i for i, _ in done_slots}
        dead_pids = self.s_pid[sorted(gone)].tolist()
        B = len(self._slots)
        keep = B - len(gone)
        holes = sorted(i for i in gone if i < keep)
        movers = [i for i in range(keep, B) if i not in gone]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            srcs = torch.tensor(movers, device=self.device)
            if self.kv is not None:
                T = int((self.s_pos[srcs] - self.s_plen[srcs]).max()) + 1
                self.kv.k[:, dst, :, :T] = self.kv.k[:, srcs, :, :T]
                self.kv.v[:, dst, :, :T] = self.kv.v[:, srcs, :, :T]
            for t in self._state_tensors:
                t[dst] = t[srcs]
            for h, m in zip(holes, movers, strict=True):
                self._slots[h] = self._slots[m]
        del self._slots[keep:]
        if self.kv is not None:
            remap = self.kv.release(dead_pids)
            if remap is not None and keep:
                self.s_pid[:keep] = remap[self.s_pid[:keep]]
        self._membership_changed()
        return results


def _load_kernels(
    mode: str, head_dim: int, dtype: torch.dtype, device: torch.device
) -> _kernels.DecodeKernels | None:
    """Resolve the ``kernels`` option (see ``NativeBackend``) to loaded kernels or None."""
    if mode not in ("auto", "fused", "torch"):
        raise ValueError(f"kernels={mode!r} is not one of 'auto', 'fused', 'torch'")
    if mode == "torch":
        return None
    why = _kernels.supports(head_dim, dtype, device)
    kern = _kernels.load() if why is None else None
    if kern is None:
        why = why or _kernels.build_error()
        if mode == "fused":
            raise RolloutError(
                f"native engine: kernels='fused' but the fused CPU kernels cannot run: {why}; "
                f"use kernels='auto' or 'torch'"
            )
        logger.info("native engine: decoding with torch ops (fused kernels off: %s)", why)
    return kern


def _set_exc(fut: asyncio.Future, err: Exception) -> None:
    if not fut.done():
        fut.set_exception(err)


def _set_res(fut: asyncio.Future, out: TokenOutput) -> None:
    if not fut.done():
        fut.set_result(out)


def _resolve(req: _Request, out: TokenOutput) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is req.loop:
        _set_res(req.future, out)
    elif not req.loop.is_closed():
        req.loop.call_soon_threadsafe(_set_res, req.future, out)
