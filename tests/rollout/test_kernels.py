"""The fused CPU decode kernels against plain torch formulas, and the engine's kernel switch."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from postrl.rollout import RolloutError, SamplingParams, create_rollout_backend
from postrl.rollout.native import kernels
from postrl.rollout.native.model import apply_rope

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: the engine runs its torch path (tested elsewhere)",
)


@pytest.fixture(scope="module")
def kern():
    k = kernels.load()
    assert k is not None, f"kernels failed to build/load: {kernels.build_error()}"
    return k


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_rms_norm(kern):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 96, generator=g) * 3, torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-6), _rms(x, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_rotates_in_place_and_writes_the_cache(kern, qk_norm):
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, D, S, Tmax, eps = 5, 6, 2, 16, 8, 12, 1e-6
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g)
    pos = torch.tensor([3, 7, 5, 9, 4])
    plen = torch.tensor([2, 6, 5, 1, 4])
    ang = torch.rand(32, D // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    qn, kn = (
        (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5)
        if qk_norm
        else (None, None)
    )
    kc, vc = torch.zeros(S, Hkv, Tmax, D), torch.zeros(S, Hkv, Tmax, D)
    q, k, v = qkv.clone().split([H * D, Hkv * D, Hkv * D], -1)
    q, k, v = q.reshape(B, H, D), k.reshape(B, Hkv, D), v.reshape(B, Hkv, D)
    if qk_norm:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    c, s = cos[pos][:, None], sin[pos][:, None]
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    slot = torch.tensor([4, 0, 7, 2, 5])  # any cache slot per row
    kern.rope_kv(qkv, H, Hkv, D, cos, sin, pos, slot, pos - plen, qn, kn, eps, kc, vc)
    torch.testing.assert_close(qkv[:, : H * D].reshape(B, H, D), q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        qkv[:, H * D : (H + Hkv) * D].reshape(B, Hkv, D), k, rtol=1e-5, atol=1e-5
    )
    for b in range(B):
        off, sb = int(pos[b] - plen[b]), int(slot[b])
        torch.testing.assert_close(kc[sb, :, off], k[b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[sb, :, off], v[b])
        kc[sb, :, off] = 0
    assert kc.abs().sum() == 0  # nothing else written


# head_dim % 16 == 0 takes the 16-wide kernels (blocks of 8 K rows, 64-column V blocks, head
# pairs plus a single head when the group is odd); other multiples of 8 the 8-wide ones
@pytest.mark.parametrize(
    ("H", "Hkv", "D"),
    [
        (4, 2, 64),
        (6, 2, 24),
        (3, 3, 8),
        (8, 1, 40),
        (4, 2, 128),
        (6, 2, 16),
        (2, 2, 48),
        (3, 1, 80),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_equals_softmax_reference(kern, H, Hkv, D, threads):
    """Each row: softmax over [its prompt's prefix keys, its own keys 0..off] — checked against
    an explicit torch computation, with ragged prompt lengths, offsets and shared prefixes."""
    g = torch.Generator().manual_seed(H * 100 + D)
    B, S, Tmax = 9, 9, 20
    G = H // Hkv
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g)
    pk, pv, kc, vc = (torch.randn(S, Hkv, Tmax, D, generator=g) for _ in range(4))
    pid = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 0])
    plen = torch.tensor([5, 5, 1, 12, 12, 12, 7, 19, 5])
    pos = plen + torch.tensor([0, 3, 0, 6, 1, 0, 12, 0, 7])  # own offsets 0 .. 12
    scale = D**-0.5
    out = kern.decode_attention(qkv, H, Hkv, D, pk, pv, kc, vc, pid, plen, pos, scale, threads)
    for b in range(B):
        n1, n2 = int(plen[b]), int(pos[b] - plen[b]) + 1
        for h in range(H):
            kh = h // G
            q = qkv[b, h * D : (h + 1) * D]
            K = torch.cat([pk[pid[b], kh, :n1], kc[b, kh, :n2]])
            V = torch.cat([pv[pid[b], kh, :n1], vc[b, kh, :n2]])
            ref = torch.softmax(K @ q * scale, 0) @ V
            torch.testing.assert_close(out[b, h * D : (h + 1) * D], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [3, 700])  # serial and OpenMP-parallel paths
def test_silu_mul(kern, rows):
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(rows, 2 * 384, generator=g) * 6
    ref = torch.nn.functional.silu(gu[:, :384]) * gu[:, 384:]
    torch.testing.assert_close(kern.silu_mul(gu), ref, rtol=1e-5, atol=1e-5)


def test_sample_equals_torch_sampler(kern):
    """The C sampler draws the same tokens as ``sampler.sample_tokens`` (same counter-based
    uniforms, including negative seeds and greedy rows) with log-probs equal to float rounding."""
    from postrl.rollout.native.sampler import sample_tokens

    g = torch.Generator().manual_seed(5)
    B, V = 2000, 264
    logits = torch.randn(B, V, generator=g) * 3
    temp = torch.rand(B, generator=g) * 1.5
    temp[::7] = 0.0  # greedy rows
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    counters = torch.randint(0, 500, (B,), generator=g)
    ref_t, ref_lp = sample_tokens(
        logits, temp, torch.zeros(B, dtype=torch.long), torch.ones(B), seeds, counters, False
    )
    tok, lp = kern.sample(logits, temp, seeds, counters)
    assert (
        tok == ref_t
    ).float().mean() > 0.999  # a flip needs u within float rounding of a CDF step
    same = tok == ref_t
    torch.testing.assert_close(lp[same], ref_lp[same], rtol=0, atol=1e-5)


def test_bad_tensors_are_refused(kern):
    with pytest.raises(ValueError, match="x: needs a contiguous CPU torch.float32"):
        kern.rms_norm(torch.zeros(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x: needs a contiguous"):
        kern.rms_norm(torch.zeros(8, 4).t(), torch.ones(8), 1e-6)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernels_share_torchs_openmp_runtime(kern):
    """An OpenMP build of the kernels runs on torch's runtime: one OpenMP library in the process,
    not a second team of threads."""
    if "-fopenmp" in kern.flags.split():
        assert len(kernels.openmp_runtimes()) == 1, kernels.openmp_runtimes()
    else:
        assert kern.flags != "?"


def _run(be, prompts, sp):
    async def go():
        return await asyncio.gather(*[be.generate(p, sp, f"r{i}") for i, p in enumerate(prompts)])

    return asyncio.run(go())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_fused_equals_torch_path(tiny_model_factory, arch):
    """Same requests (shared and distinct prompts, sampled, ragged finishes through EOS) through
    kernels='fused' and kernels='torch': same tokens, log-probs equal to float rounding."""
    d = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(3)
    base = [
        torch.randint(0, 256, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(6)
    ]
    prompts = [p for p in base[:3] for _ in range(4)] + base[3:]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=11, logprobs=True)
    outs = {}
    for mode in ("fused", "torch"):
        be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=64, kernels=mode)
        assert (be.kernels is not None) == (mode == "fused")
        outs[mode] = _run(be, prompts, sp)
        be.close()
    for a, b in zip(outs["fused"], outs["torch"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_whole_step_equals_per_op_kernels(tiny_model_factory, arch):
    """``DecodeStep`` (one C call, GEMMs via torch's BLAS) against ``decode_fused`` (per-op) — the
    guarantee stated in ``kernels.py``: the same ``sgemm_`` shapes in the same order, but the
    per-op path calls BLAS through torch (its thread count, its entry point) and the step calls
    ``sgemm_`` itself, and MKL picks its kernel and blocking by ISA and threads (bit-equal on
    AVX-512 machines, last bits on AVX2-only Zen 3); row-split over threads, each GEMM covers a row
    subset. Both are held to the stated tolerance; the same call twice is bit-equal."""
    from postrl.rollout.native.forward import decode_fused

    d = tiny_model_factory(arch)
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=64)
    _run(
        be, [[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=2)
    )  # engine warm, store live
    step = be.kernels.decode_step(be.weights, be.cfg, be.kv, 8)
    assert step is not None, "torch's sgemm_ was not resolved"
    g = torch.Generator().manual_seed(4)
    B = 6
    with torch.inference_mode():
        be.kv.pk.normal_(generator=g)  # arbitrary prefix K/V
        be.kv.pv.normal_(generator=g)
        tok = torch.randint(0, 256, (B,), generator=g)
        plen = torch.tensor([3, 3, 9, 9, 9, 20])
        pos = plen + torch.tensor([0, 4, 1, 1, 7, 2])
        pid = torch.tensor([0, 0, 1, 1, 1, 2])
        slot = torch.arange(B)
        ref = decode_fused(
            be.weights, be.cfg, be.kernels, tok, pos, plen, pid, be.cos, be.sin, be.kv, be._ar_s, 1
        )
        k_ref, v_ref = be.kv.k.clone(), be.kv.v.clone()
        be.kv.k.zero_()
        be.kv.v.zero_()
        out = step(tok, pos, plen, pid, slot, be.cos, be.sin, 1)
    written = (k_ref != 0, v_ref != 0)
    # the same cache entries are written (nothing else), each within the stated tolerance
    assert torch.equal(be.kv.k != 0, written[0]) and torch.equal(be.kv.v != 0, written[1])
    for got, want in ((out, ref), (be.kv.k, k_ref), (be.kv.v, v_ref)):
        tol = kernels.row_split_tolerance(be.cfg) * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=tol)
    with torch.inference_mode():  # the one-thread step is deterministic: twice, bit-equal
        assert torch.equal(step(tok, pos, plen, pid, slot, be.cos, be.sin, 1), out)
    step.row_split = True  # rows split over 3 threads for the whole step: GEMMs over row subsets
    with torch.inference_mode():
        out3 = step(tok, pos, plen, pid, slot, be.cos, be.sin, 3)
    # the same cache entries are written (nothing else), each within the row-split tolerance
    assert torch.equal(be.kv.k != 0, written[0]) and torch.equal(be.kv.v != 0, written[1])
    for got, want in ((out3, ref), (be.kv.k, k_ref), (be.kv.v, v_ref)):
        tol = kernels.row_split_tolerance(be.cfg) * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=tol)
    k3 = be.kv.k.clone()
    with torch.inference_mode():  # and a row-split step is deterministic: twice, bit-equal
        assert torch.equal(step(tok, pos, plen, pid, slot, be.cos, be.sin, 3), out3)
    assert torch.equal(be.kv.k, k3)
    assert be._decode_step() is not None
    be.sleep()
    assert be._step_fn is None  # does not keep the released store alive
    be.wake_up()
    assert be._decode_step().kv is be.kv
    be.close()


def test_kernel_option_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="kernels='bogus' is not one of"):
        create_rollout_backend(
            "native", tiny_model_dir, max_num_seqs=2, max_model_len=32, kernels="bogus"
        )
    with pytest.raises(RolloutError, match="dtype torch.bfloat16"):
        create_rollout_backend(
            "native",
            tiny_model_dir,
            max_num_seqs=2,
            max_model_len=32,
            kernels="fused",
            dtype="bfloat16",
        )
    be = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=2, max_model_len=32, dtype="bfloat16"
    )
    assert be.kernels is None  # auto: the torch path, not an error


def _fresh_loader(monkeypatch):
    """A loader that has not tried yet (the module's own keeps its loaded library)."""
    once = kernels._ONCE
    monkeypatch.setattr(kernels, "_ONCE", type(once)(once.src, once.prefix, once.wrap, once.what))


def test_disabled_by_environment(monkeypatch):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("POSTRL_KERNELS", "0")
    assert kernels.load() is None
    assert "POSTRL_KERNELS=0" in kernels.build_error()


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("POSTRL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernels.load() is None
    assert "no-such-compiler" in kernels.build_error()


def test_cache_dir_must_be_private(monkeypatch, tmp_path):
    """A world-writable cache directory is never used (someone else could plant a library)."""
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    (shared / "kernels").chmod(0o777)
    monkeypatch.setenv("POSTRL_CACHE_DIR", str(shared))
    assert kernels._cache_dir() != shared / "kernels"
    monkeypatch.setenv("POSTRL_CACHE_DIR", str(tmp_path / "mine"))
    d = kernels._cache_dir()
    assert d == tmp_path / "mine" / "kernels" and not d.stat().st_mode & 0o022


_OVERFLOW = """
import torch
from postrl.rollout.native import kernels
k = kernels.load()
assert k is not None, kernels.build_error()
x, w, out = torch.randn(4, 8), torch.ones(8), torch.empty(4, 8)
k._lib.postrl_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 5, 8, 1e-6)  # 1 row too many
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not sys.platform.startswith("linux") or kernels.sanitizer_preload() is None,
    reason="needs Linux and a compiler with the ASan runtime (gcc/clang libasan.so)",
)
def test_kernels_under_address_and_ub_sanitizers(tmp_path):
    """This file's tests and the training kernels' (``tests/kernels/test_train_kernels.py``)
    again (2 threads, so the OpenMP and row-split paths run) against the libraries built with
    ``-fsanitize=address,undefined`` (``POSTRL_KERNEL_SANITIZE=1``): an out-of-bounds access or UB
    aborts them. A deliberate one-row overflow proves ASan is live."""
    env = dict(
        os.environ,
        LD_PRELOAD=kernels.sanitizer_preload(),
        ASAN_OPTIONS="detect_leaks=0",
        POSTRL_KERNEL_SANITIZE="1",
        POSTRL_CACHE_DIR=str(tmp_path),
        OMP_NUM_THREADS="2",
    )
    train = str(Path(__file__).resolve().parents[1] / "kernels" / "test_train_kernels.py")
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, train]
    args += ["-k", "not sanitizers"]
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
    flags = sorted((tmp_path / "kernels").glob("*.flags"))
    assert [f.name.split("-")[0] for f in flags] == ["decode", "train"], flags
    assert all("-fsanitize=address,undefined" in f.read_text() for f in flags)
    bad = subprocess.run(
        [sys.executable, "-c", _OVERFLOW], env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode != 0 and "heap-buffer-overflow" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_shared_prefix_trunk_equals_whole_prompt_prefill(tiny_model_factory, arch):
    """``share_prefix``: prompts that open with the same 16 tokens (a chat template's head) get
    those positions' K/V copied from the trunk and prefill only their tails. Against the torch
    path, which prefills every prompt whole: the same tokens and log-probs to float rounding —
    through a lone first prompt (the trunk seeded from it, then cut to what the family shares),
    waves larger than the slots, prompts no longer than the trunk, weight updates (the trunk's
    K/V recomputed under the new weights, once right before the trunk is cut, so prompts share
    more with it than it then holds) and a second family of prompts (the trunk re-seeded)."""
    from transformers import AutoModelForCausalLM

    d = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(5)

    def rand(n):
        return torch.randint(0, 256, (n,), generator=g).tolist()

    head, other = rand(16), rand(12)
    family = [head + rand(int(torch.randint(1, 9, (1,), generator=g))) for _ in range(9)]
    family += [head[:10] + rand(3), head[:16], head[:9]]  # shorter than the trunk, or equal
    family[0] = head + rand(6)  # the lone first prompt: the trunk is all of it but its last
    family[1] = family[0][:20] + rand(2)  # shares 20 with that trunk, the rest 16 or fewer
    strangers = [other + rand(4), other + rand(6)]
    model = AutoModelForCausalLM.from_pretrained(d)
    new_weights = [
        (k, p.detach() + 0.02 * torch.randn(p.shape, generator=g))
        for k, p in model.named_parameters()
    ]
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, logprobs=True)
    waves = [family[:1], "update", family[1:], "update", family[:6] + strangers]
    waves += [strangers + family[6:], family[1:5]]
    outs, shared = {}, {}
    for mode in ("fused", "torch"):
        be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=64, kernels=mode)
        assert be.share_prefix == (mode == "fused")
        outs[mode] = []
        for wave in waves:
            if wave == "update":
                be.update_weights(iter(new_weights))
            else:
                outs[mode] += _run(be, wave, sp)
        shared[mode] = be.prefill_tokens_shared
        be.close()
    assert shared["torch"] == 0 and shared["fused"] >= 16 * 10, shared
    assert len(outs["fused"]) == len(outs["torch"]) == 1 + 11 + 8 + 8 + 4
    for a, b in zip(outs["fused"], outs["torch"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), rtol=0, atol=1e-5
        )


def test_a_request_joining_a_live_prompt_prefills_nothing(tiny_model_factory):
    """Two slots, three samples of one prompt: the third is admitted when the short first one
    finishes, while the second still runs — its prompt's row is live, so the admission has
    nothing to prefill. Same tokens as the torch path."""
    d = tiny_model_factory("qwen2")
    prompt = list(range(30, 52))
    outs = {}
    for mode in ("fused", "torch"):
        be = create_rollout_backend("native", d, max_num_seqs=2, max_model_len=64, kernels=mode)

        async def go(be=be):
            sps = [SamplingParams(temperature=1.0, max_new_tokens=m, seed=3) for m in (2, 10, 4)]
            return await asyncio.gather(
                *(be.generate(prompt, sp, f"r{i}") for i, sp in enumerate(sps))
            )

        outs[mode] = asyncio.run(go())
        tokens = be.prefill_tokens
        be.close()
        assert tokens == len(prompt), (mode, tokens)  # one prefill of the prompt, no other
    assert [o.token_ids for o in outs["fused"]] == [o.token_ids for o in outs["torch"]]
    assert [len(o.token_ids) for o in outs["fused"]] == [2, 10, 4]


def test_shared_prefix_off_prefills_whole_prompts(tiny_model_factory):
    """``share_prefix=False``: nothing copied, every prompt position prefilled."""
    d = tiny_model_factory("qwen2")
    head = list(range(20, 40))
    prompts = [head + [i, i + 1] for i in range(4)]
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=64, share_prefix=False)
    _run(be, prompts, SamplingParams(temperature=0.0, max_new_tokens=2))
    assert be.prefill_tokens_shared == 0 and be.prefill_tokens == 4 * 22
    be.close()
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=64)
    _run(be, prompts, SamplingParams(temperature=0.0, max_new_tokens=2))
    # the trunk (the 20 shared positions) once, then each prompt's own 2
    assert (be.prefill_tokens, be.prefill_tokens_shared) == (20 + 4 * 2, 4 * 20)
    be.close()
