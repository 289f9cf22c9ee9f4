"""Fused fp32 CPU kernels for training (``train.c``) as autograd functions.

Why: on CPU the update of a small model spends more than half its time outside its GEMMs, in
hundreds of small memory-bound ops: RMSNorm and SwiGLU (forward and backward), and the
padding-free attention's gathers, tiny batched matmuls, masks, softmax and the scatter-adds of
their backward. Measured on W1 (2 threads, AVX-512 Xeon): one layer's attention forward +
backward ≈ 5 ms of eager ops for ≈ 0.1 GFLOP of work. Each kernel here does one such block in
one pass over memory, with its backward written out (no autograd graph inside):

* :func:`rms_norm` — ``w · x / sqrt(mean(x²) + eps)`` (HF's ``RMSNorm``).
* :func:`swiglu` — ``silu(a) · u`` (the gated MLP's activation).
* :func:`rope` — ``x · cos + rotate_half(x) · sin`` (rotary position embedding), written
  token-major, the layout :func:`packed_attention` reads.
* :func:`packed_attention` — softmax attention over a packed row of groups, each a prompt and
  its responses (:class:`Segments`): prompt tokens attend causally within the prompt, response
  tokens to the whole prompt and causally within their own response. The backward recomputes
  the probabilities from the saved log-sum-exp (FlashAttention-2's backward, Dao 2023,
  arXiv 2307.08691), so the forward keeps only ``(N, H)`` floats besides its output.

What they guarantee (``tests/kernels/test_train_kernels.py``): outputs and gradients equal the
eager torch formulas to float rounding (≤ 1e-5 relative; a polynomial ``exp`` and other
summation orders), and every result is the same for any thread count (fixed loop orders; work
split so that no two threads write the same memory; no atomics).

Use: :func:`load` builds (``build.py``) and loads the library once per machine, or returns None
(the reason in :func:`build_error`, logged once) — no compiler, a failed build, or
``POSTRL_KERNELS=0``. Inputs must be fp32 CPU tensors; the callers (``engine/fused.py``) keep
torch's path for everything else.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from postrl.kernels import build

__all__ = [
    "Segments",
    "TrainKernels",
    "build_error",
    "load",
    "packed_attention",
    "rms_norm",
    "swiglu",
]

_DW_CHUNKS = 16  # RMSNorm's weight gradient: fixed row chunks, summed in order
_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int


@dataclass(frozen=True)
class Segments:
    """The packed row as groups of contiguous segments, for :func:`packed_attention`.

    Group ``g``'s segments are ``group_off[g] .. group_off[g+1]-1``: first its prompt, then each
    of its responses, in packed order; segment ``s`` covers packed tokens ``start[s] ..
    start[s] + length[s] - 1``. All int64, contiguous, on the CPU.
    """

    start: torch.Tensor
    length: torch.Tensor
    group_off: torch.Tensor

    @property
    def num_groups(self) -> int:
        return self.group_off.numel() - 1


class TrainKernels:
    """The loaded library with ctypes signatures; use the module's functions, not this."""

    def __init__(self, lib: ctypes.CDLL, path: Path | None, flags: str = "?") -> None:
        self.path, self.flags = path, flags
        lib.postrl_t_rms_fwd.argtypes = [_ptr] * 4 + [_i64, _i64, _f32, _int]
        lib.postrl_t_rms_fwd.restype = None
        lib.postrl_t_rms_bwd.argtypes = [_ptr] * 6 + [_i64, _i64, _i64, _int]
        lib.postrl_t_rms_bwd.restype = None
        lib.postrl_t_swiglu_fwd.argtypes = [_ptr] * 3 + [_i64, _int]
        lib.postrl_t_swiglu_fwd.restype = None
        lib.postrl_t_swiglu_bwd.argtypes = [_ptr] * 5 + [_i64, _int]
        lib.postrl_t_swiglu_bwd.restype = None
        lib.postrl_t_rope_fwd.argtypes = [_ptr, _i64, _i64] + [_ptr] * 3 + [_i64] * 3 + [_int]
        lib.postrl_t_rope_fwd.restype = None
        attn = [_ptr] * 3 + [_i64] * 9 + [_f32] + [_ptr] * 3 + [_i64]
        lib.postrl_t_attn_fwd.argtypes = [*attn, _ptr, _ptr, _int]
        lib.postrl_t_attn_fwd.restype = ctypes.c_int
        lib.postrl_t_attn_bwd.argtypes = [*attn] + [_ptr] * 6 + [_int]
        lib.postrl_t_attn_bwd.restype = ctypes.c_int
        self.lib = lib


_ONCE: build.Once[TrainKernels] = build.Once(
    Path(__file__).with_name("train.c"), "train", TrainKernels, "training kernels"
)


def build_error() -> str | None:
    """Why the kernels are unavailable (None when they loaded or were not tried yet)."""
    return _ONCE.error


def load() -> TrainKernels | None:
    """Build (once per machine) and load the training kernels; None when unavailable."""
    return _ONCE.load()


def _lib() -> ctypes.CDLL:
    k = load()
    if k is None:
        raise RuntimeError(f"the fused training kernels are unavailable: {build_error()}")
    return k.lib


def _check(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name}: needs a CPU float32 tensor, got {t.dtype} on {t.device}")


def _threads() -> int:
    return max(torch.get_num_threads(), 1)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        dim = x.shape[-1]
        rows = x.numel() // dim
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        _lib().postrl_t_rms_fwd(
            x.data_ptr(), w.contiguous().data_ptr(), y.data_ptr(), rstd.data_ptr(),
            rows, dim, eps, _threads(),
        )  # fmt: skip
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dim = x.shape[-1]
        dx = torch.empty_like(x)
        part = torch.empty(_DW_CHUNKS, dim, dtype=torch.float32)
        _lib().postrl_t_rms_bwd(
            x.data_ptr(), w.contiguous().data_ptr(), rstd.data_ptr(), dy.data_ptr(),
            dx.data_ptr(), part.data_ptr(), x.numel() // dim, dim, _DW_CHUNKS, _threads(),
        )  # fmt: skip
        return dx, part.sum(0) if ctx.needs_input_grad[1] else None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        a, u = a.contiguous(), u.contiguous()
        h = torch.empty_like(a)
        _lib().postrl_t_swiglu_fwd(a.data_ptr(), u.data_ptr(), h.data_ptr(), a.numel(), _threads())
        ctx.save_for_backward(a, u)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        a, u = ctx.saved_tensors
        dh = dh.contiguous()
        da, du = torch.empty_like(a), torch.empty_like(u)
        _lib().postrl_t_swiglu_bwd(
            a.data_ptr(), u.data_ptr(), dh.data_ptr(), da.data_ptr(), du.data_ptr(), a.numel(),
            _threads(),
        )  # fmt: skip
        return da, du


def _rope_call(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    n, h, d = x.shape
    out = torch.empty(n, h, d, dtype=torch.float32)
    _lib().postrl_t_rope_fwd(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
        out.data_ptr(), n, h, d, _threads(),
    )  # fmt: skip
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rope_call(x, cos, sin)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # the transposed rotation is the rotation with sin' = -[sin2, sin1] (train.c's formula)
        cos, sin = ctx.saved_tensors
        half = sin.shape[1] // 2
        return _rope_call(dy.contiguous(), cos, -sin.roll(half, 1)), None, None


def _attn_call(fn: str, q, k, v, segs: Segments, scale: float, *out: torch.Tensor) -> None:
    """``fn`` (the attention's forward or backward) on q, k, v, the layout and ``out``'s
    pointers."""
    n, h, d = q.shape
    rc = getattr(_lib(), fn)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        h, k.shape[1], d, scale,
        segs.start.data_ptr(), segs.length.data_ptr(), segs.group_off.data_ptr(),
        segs.num_groups, *(t.data_ptr() for t in out), _threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("packed_attention: a thread could not allocate its score buffer")


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segs: Segments, scale: float) -> torch.Tensor:
        n, h, d = q.shape
        o = torch.empty(n, h, d, dtype=torch.float32)
        lse = torch.empty(n, h, dtype=torch.float32)
        _attn_call("postrl_t_attn_fwd", q, k, v, segs, scale, o, lse)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.segs, ctx.scale = segs, scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        dq = torch.empty(q.shape, dtype=torch.float32)
        dk = torch.zeros(k.shape, dtype=torch.float32)
        dv = torch.zeros(v.shape, dtype=torch.float32)
        _attn_call("postrl_t_attn_bwd", q, k, v, ctx.segs, ctx.scale, o, lse, do, dq, dk, dv)
        return dq, dk, dv, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x²) + eps)`` over the last dim (fp32 CPU; differentiable)."""
    _check("x", x)
    _check("weight", weight)
    return _RMSNorm.apply(x, weight, float(eps))


def swiglu(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(a) · u`` elementwise (fp32 CPU, same shapes; differentiable)."""
    _check("a", a)
    _check("u", u)
    if a.shape != u.shape:
        raise ValueError(f"swiglu: a {tuple(a.shape)} and u {tuple(u.shape)} differ")
    return _SwiGLU.apply(a, u)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x · cos + rotate_half(x) · sin`` for ``x`` (N, H, D) (any strides with D contiguous) and
    the tokens' ``cos``/``sin`` rows (N, D) -> (N, H, D) contiguous. Differentiable in ``x``."""
    _check("x", x)
    if x.dim() != 3 or x.stride(2) != 1 or x.shape[-1] % 2:
        raise ValueError("rope: x must be (N, heads, D) with D even and contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape:
        raise ValueError(
            f"rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be (N, D) = "
            f"{(x.shape[0], x.shape[2])}"
        )
    _check("cos", cos)
    _check("sin", sin)
    return _Rope.apply(x, cos, sin)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: Segments, scale: float
) -> torch.Tensor:
    """Attention of the packed row ``segs`` describes: (N, H, D) queries, (N, Hkv, D) keys and
    values (any strides with each head's D floats contiguous; ``H`` a multiple of ``Hkv``) ->
    (N, H, D) contiguous outputs. Differentiable in q, k and v."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t)
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"packed_attention: {name} must be (N, heads, D) with D contiguous")
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"packed_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return _PackedAttention.apply(q, k, v, segs, float(scale))
