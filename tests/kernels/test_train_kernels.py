"""The fused training kernels (postrl/kernels/train.c) against torch's ops: outputs and gradients
to float rounding, and any thread count giving the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from postrl.engine.logprob import pack
from postrl.engine.varlen import varlen_attention
from postrl.kernels import train as T

if T.load() is None:  # the suite's machines have a C compiler; say why when one does not
    pytest.skip(f"training kernels unavailable: {T.build_error()}", allow_module_level=True)


def _close(a, b, rel=1e-5):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a - b).abs().max().item() <= rel * scale, ((a - b).abs().max().item(), scale)


def test_rms_norm_forward_and_backward_equal_the_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 256, generator=g) * 3  # 111 rows: not a multiple of the 16 chunks
    w = torch.randn(256, generator=g)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = w1 * (x1 * torch.rsqrt(x1.pow(2).mean(-1, keepdim=True) + 1e-6))
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = T.rms_norm(x2, w2, 1e-6)
    _close(out, ref)
    dy = torch.randn(ref.shape, generator=g)
    _close(torch.autograd.grad(out, (x2, w2), dy)[0], torch.autograd.grad(ref, (x1, w1), dy)[0])
    out = T.rms_norm(x2, w2, 1e-6)
    ref = w1 * (x1 * torch.rsqrt(x1.pow(2).mean(-1, keepdim=True) + 1e-6))
    _close(torch.autograd.grad(out, w2, dy)[0], torch.autograd.grad(ref, w1, dy)[0])


def test_swiglu_forward_and_backward_equal_the_formula():
    g = torch.Generator().manual_seed(1)
    a = torch.cat([torch.randn(5000, generator=g) * 4, torch.tensor([0.0, -40.0, 40.0, 1e-8])])
    u = torch.randn(a.shape, generator=g)
    a1, u1 = a.clone().requires_grad_(), u.clone().requires_grad_()
    ref = F.silu(a1) * u1
    a2, u2 = a.clone().requires_grad_(), u.clone().requires_grad_()
    out = T.swiglu(a2, u2)
    _close(out, ref)
    dh = torch.randn(a.shape, generator=g)
    for got, want in zip(
        torch.autograd.grad(out, (a2, u2), dh), torch.autograd.grad(ref, (a1, u1), dh), strict=True
    ):
        _close(got, want)


def test_rope_forward_and_backward_equal_the_formula():
    """``x·cos + rotate_half(x)·sin`` on a head-major strided view, as HF's attention holds q."""
    g = torch.Generator().manual_seed(5)
    n, h, d = 40, 4, 64
    proj = torch.randn(n, h * d, generator=g)
    ang = torch.randn(n, d // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rotate_half(x):
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)

    x1 = proj.clone().requires_grad_()
    xv = x1.view(n, h, d)
    ref = xv * cos.unsqueeze(1) + rotate_half(xv) * sin.unsqueeze(1)
    x2 = proj.clone().requires_grad_()
    view = x2.view(1, n, h, d).transpose(1, 2)[0].transpose(0, 1)  # (N, H, D), strided
    out = T.rope(view, cos, sin)
    assert out.is_contiguous()
    _close(out, ref)
    dy = torch.randn(ref.shape, generator=g)
    _close(torch.autograd.grad(out, x2, dy)[0], torch.autograd.grad(ref, x1, dy)[0])


def _packed_batch(share: bool, seed: int = 0):
    """Groups of 4 rows sharing a prompt (3..7 tokens); responses of 0..7 tokens (some empty)."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = 12, 9, 7
    ids = torch.randint(3, 50, (b, p + r), generator=g)
    am = torch.zeros(b, p + r, dtype=torch.long)
    for i in range(b):
        pl, rl = 3 + (i // 4) % 5, (i * 3) % (r + 1)
        am[i, p - pl : p] = 1
        am[i, p : p + rl] = 1
        ids[i, :p] = ids[(i // 4) * 4, :p]
    return pack(ids * am, am, r, share_prefix=share)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (2, 2, 32), (4, 1, 128)])
def test_packed_attention_equals_the_torch_path(share, heads, kv_heads, dim):
    """Against varlen_attention's torch ops (gathers, masked softmax, SDPA), forward and the
    gradients of q, k and v, in the strides the HF attention hands over (q, k head-major after
    RoPE; v a transposed view of the projection)."""
    pk = _packed_batch(share)
    n = pk.num_tokens
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, heads, n, dim, generator=g).requires_grad_()
    k = torch.randn(1, kv_heads, n, dim, generator=g).requires_grad_()
    v = torch.randn(1, n, kv_heads, dim, generator=g).transpose(1, 2).detach().requires_grad_()
    scale = dim**-0.5
    ref, _ = varlen_attention(None, q, k, v, None, scaling=scale, postrl_layout=pk.layout)
    do = torch.randn(ref.shape, generator=g)
    want = torch.autograd.grad(ref, (q, k, v), do)
    out = T.packed_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), pk.layout.segments, scale)
    _close(out, ref[0])
    for got, w in zip(torch.autograd.grad(out, (q, k, v), do[0]), want, strict=True):
        _close(got, w)


def test_results_do_not_depend_on_the_thread_count():
    pk = _packed_batch(True, seed=3)
    n = pk.num_tokens
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (4, 2, 2))
    x, w = torch.randn(300, 256, generator=g), torch.randn(256, generator=g)
    a, u = torch.randn(300, 512, generator=g), torch.randn(300, 512, generator=g)
    cos, sin = torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)

    def run():
        qq, kk, vv, xx, ww, aa, uu = (t.clone().requires_grad_() for t in (q, k, v, x, w, a, u))
        outs = [
            T.packed_attention(T.rope(qq, cos, sin), kk, vv, pk.layout.segments, 0.125),
            T.rms_norm(xx, ww, 1e-6),
            T.swiglu(aa, uu),
        ]
        sum((o * o).sum() for o in outs).backward()
        return [*outs, *(t.grad for t in (qq, kk, vv, xx, ww, aa, uu))]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    for x1, x2 in zip(one, two, strict=True):
        assert torch.equal(x1, x2)


def test_bad_inputs_are_refused_with_the_reason():
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        T.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="differ"):
        T.swiglu(torch.randn(3, 4), torch.randn(3, 5))
    pk = _packed_batch(True)
    q = torch.randn(pk.num_tokens, 3, 64)
    with pytest.raises(ValueError, match="shapes"):
        T.packed_attention(q, torch.randn(pk.num_tokens, 2, 64), q[:, :2], pk.layout.segments, 1.0)
