"""Fused fp32 CPU decode kernels (``kernels.c``), compiled at first use and called via ctypes.

Why: on CPU the decode step of a small model is dominated not by its matmuls but by the ~25
small ops per layer around them (RMSNorm, RoPE, cache writes, the grouped attention's copies,
mask, softmax) — each a dispatch, an allocation and a pass over memory. Three kernels replace
them: ``rms_norm``, ``rope_kv`` (q/k-norm + RoPE in place + K/V cache write) and
``decode_attention`` (prompt prefix + own completion under one softmax, rows split over the
OpenMP threads). The matmuls stay with torch (MKL/oneDNN).

Build: ``postrl/kernels/build.py`` (``-O3 -march=native -fopenmp``, the kernels' threads are
torch's OpenMP pool; single-threaded fallbacks; cached under ``$POSTRL_CACHE_DIR``
(default ``~/.cache/postrl``)``/kernels/decode-<hash>.so``, keyed by the source, the flags and the
CPU's feature flags; ~1 s once per machine). No compiler, a failed build or ``POSTRL_KERNELS=0``
→ ``load()`` returns None and the engine uses its torch path (logged once, never silent).

Sanitizers: ``POSTRL_KERNEL_SANITIZE=1`` builds with ``-fsanitize=address,undefined`` (any
finding aborts) into its own cache entry; Python must start with ``LD_PRELOAD`` =
``sanitizer_preload()`` and ``ASAN_OPTIONS=detect_leaks=0``, else ``load()`` refuses with that
fix. ``make test-sanitize`` (or the slow test ``test_kernels_under_address_and_ub_sanitizers``)
runs the kernel tests that way.

What the fused path guarantees (tested in ``tests/rollout/test_kernels.py``), on one machine:

- **The same operations in the same order.** ``DecodeStep`` on one thread (or with
  ``row_split`` off) makes the same ``sgemm_`` calls, on the same shapes and in the same order,
  as the per-op path ``forward.decode_fused`` (``F.linear``/``addmm`` → MKL), and the C ops
  between them are the same functions. The per-op path reaches BLAS through torch (its threads,
  its entry point), the step calls ``sgemm_`` itself, and MKL picks kernel and blocking by ISA
  and thread count: logits and K/V writes are bit-equal on AVX-512 machines and differ in the
  last bits on AVX2-only Zen 3, so the tested bound is the tolerance below. Every kernel
  is row-local with a fixed loop order (OpenMP ``schedule(static)`` splits over rows, no
  reductions across threads, no atomics), so a step is deterministic run to run at a fixed
  thread count, and so is the row split (rows ``B·t/threads ..``).
- **A stated tolerance where BLAS blocking differs.** Row-split over ``threads``, each thread's
  GEMMs cover only its rows (M = its share instead of B); BLAS picks its kernel and blocking
  by shape and ISA, so a dot product of length K may be summed in another order (bit-equal on
  the AVX-512 Intel machine this was first tested on, last-bit differences on AVX2-only AMD
  Zen 3). Two orders of a float32 sum of K products differ by at most ``2·γ_K·Σ|x_i·w_i|``
  with ``γ_K ≈ K·u``, ``u = eps/2`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
  §3.1); the stated bound is ``|Δ| ≤ row_split_tolerance(cfg) · max|ref|`` =
  ``eps·K_max·max|ref|``, K_max the largest GEMM inner dimension of the model (hidden, H·D or
  intermediate size). Measured on the tiny models (K_max = 512, bound 6.1e-5 relative) on
  Zen 3: logits and K/V differ by ≤ 2e-6, ≈100× inside it.
- Against the torch path (``kernels="torch"``): float rounding only (a polynomial ``exp``,
  other summation orders and FMAs), logits ≈1e-6, log-probs ≤1e-5; greedy tokens equal.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from postrl.kernels import build
from postrl.kernels.build import openmp_runtimes, sanitizer_preload

__all__ = [
    "DecodeKernels",
    "DecodeStep",
    "load",
    "build_error",
    "supports",
    "openmp_runtimes",
    "row_split_tolerance",
    "sanitizer_preload",
]

logger = logging.getLogger(__name__)

_MAX_HEAD_DIM = 1024  # stack buffers in kernels.c
_cache_dir = build.cache_dir  # (tests check the cache directory's privacy through this name)

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class DecodeKernels:
    """The loaded library, with tensor-level wrappers that check dtypes, devices and layout."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None, flags: str = "?") -> None:
        self.path = path
        self.flags = flags
        lib.postrl_rms_norm.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _f32]
        lib.postrl_rms_norm.restype = None
        lib.postrl_rope_kv.argtypes = [
            _ptr,
            _i64,
            _i64,
            _i64,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _f32,
            _ptr,
            _ptr,
            _i64,
        ]
        lib.postrl_silu_mul.argtypes = [_ptr, _ptr, _i64, _i64]
        lib.postrl_silu_mul.restype = None
        lib.postrl_rope_kv.restype = None
        lib.postrl_decode_attention.argtypes = [
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _i64,
            _i64,
            _i64,
            _i64,
            _i64,
            _f32,
            _i64,
        ]
        lib.postrl_decode_attention.restype = ctypes.c_int
        lib.postrl_decode_step.argtypes = [_ptr] * 14 + [_i64, _f32, _f32, _i64, _i64, _ptr, _ptr]
        lib.postrl_decode_step.restype = ctypes.c_int
        lib.postrl_sample.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
        lib.postrl_sample.restype = None
        self._lib = lib
        self.sgemm = _torch_sgemm()

    @staticmethod
    def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> int:
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"{name}: needs a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device} "
                f"(contiguous={t.is_contiguous()})"
            )
        return t.data_ptr()

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """``w * x / sqrt(mean(x²) + eps)`` over the last dim of ``x`` (rows, dim)."""
        out = torch.empty_like(x)
        dim = x.shape[-1]
        self._lib.postrl_rms_norm(
            self._check("x", x, torch.float32),
            self._check("w", w, torch.float32),
            out.data_ptr(),
            x.numel() // dim,
            dim,
            eps,
        )
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """SwiGLU on the fused gate/up output ``gu`` (rows, 2I): ``silu(g) · u`` (rows, I)."""
        rows, two_i = gu.shape
        out = torch.empty(rows, two_i // 2, dtype=gu.dtype)
        self._lib.postrl_silu_mul(
            self._check("gu", gu, torch.float32), out.data_ptr(), rows, two_i // 2
        )
        return out

    def rope_kv(
        self,
        qkv: torch.Tensor,
        H: int,
        Hkv: int,
        D: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        slot: torch.Tensor,
        off: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        kcache: torch.Tensor,
        vcache: torch.Tensor,
    ) -> None:
        """In place on ``qkv`` (N, (H+2·Hkv)·D): q/k-norm (when given) and RoPE at ``pos`` (N,);
        row ``r``'s K and V are written to ``kcache``/``vcache`` (S, Hkv, Tmax, D) at
        ``[slot_r, :, off_r]``."""
        N = qkv.shape[0]
        self._lib.postrl_rope_kv(
            self._check("qkv", qkv, torch.float32),
            N,
            H,
            Hkv,
            D,
            self._check("cos", cos, torch.float32),
            self._check("sin", sin, torch.float32),
            self._check("pos", pos, torch.int64),
            self._check("slot", slot, torch.int64),
            self._check("off", off, torch.int64),
            None if q_norm is None else self._check("q_norm", q_norm, torch.float32),
            None if k_norm is None else self._check("k_norm", k_norm, torch.float32),
            eps,
            self._check("kcache", kcache, torch.float32),
            self._check("vcache", vcache, torch.float32),
            kcache.shape[2],
        )

    def decode_attention(
        self,
        qkv: torch.Tensor,
        H: int,
        Hkv: int,
        D: int,
        pk: torch.Tensor,
        pv: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        pid: torch.Tensor,
        plen: torch.Tensor,
        pos: torch.Tensor,
        scale: float,
        threads: int,
    ) -> torch.Tensor:
        """Attention output (B, H·D) of the q heads in ``qkv`` over each row's prompt prefix
        (``pk``/``pv`` row ``pid_b``, ``plen_b`` positions) and own completion (``kc``/``vc``
        slot ``b``, offsets ``0 .. pos_b - plen_b``)."""
        B = qkv.shape[0]
        out = torch.empty(B, H * D, dtype=qkv.dtype)
        rc = self._lib.postrl_decode_attention(
            self._check("qkv", qkv, torch.float32),
            self._check("pk", pk, torch.float32),
            self._check("pv", pv, torch.float32),
            self._check("kc", kc, torch.float32),
            self._check("vc", vc, torch.float32),
            self._check("pid", pid, torch.int64),
            self._check("plen", plen, torch.int64),
            self._check("pos", pos, torch.int64),
            out.data_ptr(),
            B,
            H,
            Hkv,
            D,
            kc.shape[2],
            scale,
            threads,
        )
        if rc != 0:
            raise MemoryError(
                "decode_attention: a worker thread could not allocate its score buffer"
            )
        return out

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        counters: torch.Tensor,
        scratch: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sampler.sample_tokens`` for rows without top-k/top-p, in C:
        ``(tokens (B,), log_probs (B,))``.

        ``scratch``: a contiguous fp32 (B, V) workspace to reuse across calls (allocated if None).
        """
        B, V = logits.shape
        tokens = torch.empty(B, dtype=torch.int64)
        logp = torch.empty(B, dtype=torch.float32)
        if scratch is None:
            scratch = torch.empty(B, V, dtype=torch.float32)
        elif scratch.shape != (B, V):
            raise ValueError(f"sample: scratch has shape {tuple(scratch.shape)}, needs {(B, V)}")
        self._lib.postrl_sample(
            self._check("logits", logits, torch.float32),
            B,
            V,
            self._check("temperature", temperature, torch.float32),
            self._check("seeds", seeds, torch.int64),
            self._check("counters", counters, torch.int64),
            tokens.data_ptr(),
            logp.data_ptr(),
            self._check("scratch", scratch, torch.float32),
        )
        return tokens, logp

    def decode_step(self, weights, cfg, kv, max_batch: int) -> DecodeStep | None:
        """A whole-step decoder over ``weights`` and the store ``kv`` (None when torch's BLAS
        ``sgemm_`` could not be resolved or a tensor is not a contiguous fp32 one)."""
        if self.sgemm is None:
            return None
        try:
            return DecodeStep(self, weights, cfg, kv, max_batch)
        except ValueError as e:
            logger.info("native engine: whole-step decode off (%s); using per-op kernels", e)
            return None


class DecodeStep:
    """``forward.decode_fused`` as ONE C call (``postrl_decode_step``): embedding, every layer
    (GEMMs through torch's own BLAS ``sgemm_``), final norm and LM head, with no Python, op
    dispatch or allocation between ops. Built per (weights, KV store): it holds raw pointers to
    both, so the engine rebuilds it when the store is re-created (``wake_up``); in-place weight
    updates keep the pointers valid.
    """

    def __init__(self, kern: DecodeKernels, weights, cfg, kv, max_batch: int) -> None:
        H, Hkv, D, inter, hid = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.hidden_size,
        )
        rows = []
        for li, lw in enumerate(weights.layers):
            ts = [
                lw.ln1,
                lw.w_qkv,
                lw.b_qkv,
                lw.w_o,
                lw.b_o,
                lw.q_norm,
                lw.k_norm,
                lw.ln2,
                lw.w_gu,
                lw.w_down,
                kv.k[li],
                kv.v[li],
                kv.pk[li],
                kv.pv[li],
            ]
            rows.append(
                [
                    0 if t is None else kern._check(f"layer {li} tensor", t, torch.float32)
                    for t in ts
                ]
            )
        self._kern, self._weights, self.kv = kern, weights, kv  # keep the pointed-to tensors alive
        self.layers = torch.tensor(rows, dtype=torch.int64)
        self.dims = torch.tensor(
            [hid, inter, H, Hkv, D, kv.k.shape[3], weights.lm_head.shape[0], len(rows)],
            dtype=torch.int64,
        )
        self.ptrs = [
            kern._check(n, t, torch.float32)
            for n, t in (
                ("embed", weights.embed),
                ("norm", weights.norm),
                ("lm_head", weights.lm_head),
            )
        ]
        self.scratch = torch.empty(max_batch * (2 * hid + (H + 2 * Hkv) * D + H * D + 3 * inter))
        self.off = torch.empty(max_batch, dtype=torch.int64)
        self.eps, self.scale, self.vocab = cfg.rms_norm_eps, D**-0.5, weights.lm_head.shape[0]
        # with several threads, split the rows over them for the whole step (one fork/join, and
        # attention overlapping GEMMs) rather than parallelising each op: measured 3-7% faster
        self.row_split = True

    def __call__(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        plen: torch.Tensor,
        pid: torch.Tensor,
        slot: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        threads: int,
    ) -> torch.Tensor:
        """Logits (B, V) of one decode step; ``tokens``/``pos``/``plen``/``pid``/``slot``: (B,)
        int64."""
        B = tokens.shape[0]
        if B > self.off.numel():
            raise ValueError(
                f"decode_step: batch {B} exceeds the {self.off.numel()} rows it was built for"
            )
        logits = torch.empty(B, self.vocab)
        k = self._kern
        rc = k._lib.postrl_decode_step(
            self._kern.sgemm,
            self.dims.data_ptr(),
            self.layers.data_ptr(),
            *self.ptrs,
            k._check("cos", cos, torch.float32),
            k._check("sin", sin, torch.float32),
            k._check("tokens", tokens, torch.int64),
            k._check("pos", pos, torch.int64),
            k._check("plen", plen, torch.int64),
            k._check("pid", pid, torch.int64),
            k._check("slot", slot, torch.int64),
            self.off.data_ptr(),
            B,
            self.eps,
            self.scale,
            threads,
            int(self.row_split),
            self.scratch.data_ptr(),
            logits.data_ptr(),
        )
        if rc != 0:
            raise MemoryError(
                "decode_step: a worker thread could not allocate its attention score buffer"
            )
        return logits


def _torch_sgemm() -> int | None:
    """Address of the BLAS ``sgemm_`` inside torch's CPU library (MKL on x86 Linux wheels), checked
    on a small product against ``torch.mm``; None when absent or wrong."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if not path.exists():
            continue
        try:
            fn = ctypes.CDLL(str(path)).sgemm_
        except (OSError, AttributeError):
            return None
        addr = ctypes.cast(fn, ctypes.c_void_p).value
        if addr and _sgemm_ok(addr):
            return addr
    return None


def _sgemm_ok(addr: int) -> bool:
    """C = X·Wᵀ through the column-major BLAS call the kernels use, compared with torch."""
    ci = ctypes.c_int
    proto = ctypes.CFUNCTYPE(
        None,
        ctypes.c_char_p,
        ctypes.c_char_p,
        *[ctypes.POINTER(ci)] * 3,
        ctypes.POINTER(_f32),
        _ptr,
        ctypes.POINTER(ci),
        _ptr,
        ctypes.POINTER(ci),
        ctypes.POINTER(_f32),
        _ptr,
        ctypes.POINTER(ci),
    )
    g = torch.Generator().manual_seed(0)
    M, N, K = 3, 5, 7
    X, W, C = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.zeros(M, N)
    m, n, k = ci(N), ci(M), ci(K)
    proto(addr)(
        b"T",
        b"N",
        ctypes.byref(m),
        ctypes.byref(n),
        ctypes.byref(k),
        ctypes.byref(_f32(1.0)),
        W.data_ptr(),
        ctypes.byref(ci(K)),
        X.data_ptr(),
        ctypes.byref(ci(K)),
        ctypes.byref(_f32(0.0)),
        C.data_ptr(),
        ctypes.byref(ci(N)),
    )
    return bool(torch.allclose(C, X @ W.t(), atol=1e-5))


def row_split_tolerance(cfg) -> float:
    """Relative bound of a row-split ``DecodeStep`` against the one-thread step (module docstring):
    ``eps32 · K_max``, K_max = the largest GEMM inner dimension of the decoder config ``cfg``."""
    k_max = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    return torch.finfo(torch.float32).eps * k_max


_ONCE: build.Once[DecodeKernels] = build.Once(
    Path(__file__).with_name("kernels.c"),
    "decode",
    DecodeKernels,
    "native engine: fused CPU kernels",
)


def build_error() -> str | None:
    """Why the kernels are unavailable (None when they loaded or were not tried yet)."""
    return _ONCE.error


def load() -> DecodeKernels | None:
    """Build (once per machine) and load the kernels; None when unavailable (reason logged once)."""
    return _ONCE.load()


def supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when the kernels can run this model, else the reason they cannot."""
    if device.type != "cpu":
        return f"device {device} (the kernels are CPU-only)"
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernels are fp32-only)"
    if head_dim > _MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim={head_dim} (needs a multiple of 8, at most {_MAX_HEAD_DIM})"
    return None
