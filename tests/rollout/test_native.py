"""The native engine against plain transformers, and its batching/sampling invariants."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from postrl.rollout import ROLLOUT_BACKENDS, RolloutError, SamplingParams, create_rollout_backend

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lens]


def _gen(be, prompts, sps):
    async def run():
        return await asyncio.gather(
            *[be.generate(p, s, f"r{i}") for i, (p, s) in enumerate(zip(prompts, sps))]
        )

    return asyncio.run(run())


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=16, max_model_len=256)
    yield be
    be.close()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_equals_transformers(tiny_model_factory, arch):
    d = tiny_model_factory(arch)
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=128)
    model = _hf(d)
    prompts = _prompts(4, seed=1)
    outs = _gen(be, prompts, [GREEDY] * len(prompts))
    for p, o in zip(prompts, outs):
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            min_new_tokens=12,
        )[0, len(p) :].tolist()
        assert o.token_ids == ref
        assert o.finish_reason == "length"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_logprobs_equal_teacher_forced(tiny_model_factory, arch):
    """Returned log-probs == log_softmax(logits / T)[token] of a plain transformers forward."""
    d = tiny_model_factory(arch)
    be = create_rollout_backend("native", d, max_num_seqs=8, max_model_len=128)
    model = _hf(d)
    prompts = _prompts(3, seed=2)
    for T, k, p in [(0.7, -1, 1.0), (1.3, 20, 0.9)]:
        sps = [
            SamplingParams(
                temperature=T, top_k=k, top_p=p, max_new_tokens=10, ignore_eos=True, seed=i
            )
            for i in range(3)
        ]
        for pr, o in zip(prompts, _gen(be, prompts, sps)):
            full = torch.tensor([pr + o.token_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(pr) - 1 : -1].float()
            ref = (
                torch.log_softmax(logits / T, -1)
                .gather(1, torch.tensor(o.token_ids)[:, None])
                .squeeze(1)
            )
            assert (ref - torch.tensor(o.log_probs)).abs().max().item() < 1e-4


def test_seeded_sampling_reproducible_and_batch_invariant(backend):
    prompts = _prompts(9, seed=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=1234)
    alone = _gen(backend, prompts[:1], [sp])[0]
    again = _gen(backend, prompts[:1], [sp])[0]
    others = [
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=n, ignore_eos=True, seed=n)
        for n in range(3, 11)
    ]
    mixed = _gen(backend, prompts, [sp] + others)[0]
    assert alone.token_ids == again.token_ids == mixed.token_ids
    other_seed = _gen(
        backend,
        prompts[:1],
        [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=99)],
    )[0]
    assert other_seed.token_ids != alone.token_ids  # the seed matters (264-way draws: collision ~0)


def test_top_k_one_is_greedy(backend):
    prompts = _prompts(3, seed=4)
    greedy = _gen(backend, prompts, [GREEDY] * 3)
    topk1 = _gen(
        backend,
        prompts,
        [
            SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12, ignore_eos=True, seed=i)
            for i in range(3)
        ],
    )
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_stop_token_ids_and_strings(backend, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = _prompts(1, seed=5)[0]
    full = _gen(backend, [prompt], [GREEDY])[0].token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    out = _gen(
        backend,
        [prompt],
        [
            SamplingParams(
                temperature=0, max_new_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True
            )
        ],
    )[0]
    assert (
        out.token_ids == full[: first + 1]
        and out.finish_reason == "stop"
        and out.stop_reason == stop_id
    )
    stop_str = tok.decode(full[5:7])
    n = next(i for i in range(1, 13) if stop_str in tok.decode(full[:i]))
    out = _gen(
        backend,
        [prompt],
        [SamplingParams(temperature=0, max_new_tokens=12, stop=(stop_str,), ignore_eos=True)],
    )[0]
    assert out.token_ids == full[:n] and out.finish_reason == "stop" and out.stop_reason == stop_str


def test_eos_stops_unless_ignored(tiny_model_dir):
    import dataclasses

    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=128)
    prompt = _prompts(1, seed=6)[0]
    full = _gen(be, [prompt], [GREEDY])[0].token_ids
    be.cfg = dataclasses.replace(be.cfg, eos_token_ids=(full[3],))  # pretend that token is EOS
    out = _gen(be, [prompt], [SamplingParams(temperature=0, max_new_tokens=12)])[0]
    assert out.token_ids == full[: full.index(full[3]) + 1] and out.finish_reason == "stop"
    assert _gen(be, [prompt], [GREEDY])[0].token_ids == full


def test_continuous_batching_64_concurrent_equals_one_by_one(tiny_model_dir):
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=16, max_model_len=128)
    prompts = _prompts(64, seed=7, lo=2, hi=40)
    sps = [
        SamplingParams(temperature=0, max_new_tokens=2 + i % 11, ignore_eos=True) for i in range(64)
    ]
    together = _gen(be, prompts, sps)
    for p, s, o in zip(prompts, sps, together):
        alone = _gen(be, [p], [s])[0]
        assert o.token_ids == alone.token_ids
        assert len(o.token_ids) == s.max_new_tokens
        torch.testing.assert_close(
            torch.tensor(o.log_probs), torch.tensor(alone.log_probs), atol=1e-5, rtol=0
        )


def test_abort_returns_partial_output(tiny_model_dir):
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=1024)
    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)

    async def run():
        task = asyncio.create_task(be.generate(prompt, sp, "long"))
        for _ in range(2000):
            await asyncio.sleep(0.005)
            if int(be.s_ngen[0]) >= 5 and be.num_running:
                break
        be.abort("long")
        return await asyncio.wait_for(task, 30)

    out = asyncio.run(run())
    assert out.finish_reason == "abort"
    assert 5 <= len(out.token_ids) < 1000 and len(out.log_probs) == len(out.token_ids)
    ref = _gen(
        be,
        [prompt],
        [SamplingParams(temperature=0, max_new_tokens=len(out.token_ids), ignore_eos=True)],
    )[0]
    assert ref.token_ids == out.token_ids


def test_shared_prefill_equals_independent(backend):
    prompt = _prompts(1, seed=9)[0]
    sps = [
        SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=100 + i)
        for i in range(8)
    ]
    shared = _gen(backend, [prompt] * 8, sps)  # one prefill, KV copied into 8 slots
    for s, o in zip(sps, shared):
        alone = _gen(backend, [prompt], [s])[0]
        assert o.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(o.log_probs), torch.tensor(alone.log_probs), atol=1e-5, rtol=0
        )
    assert len({tuple(o.token_ids) for o in shared}) > 1  # different seeds, different samples


def test_update_weights_equals_reload(tiny_model_factory):
    d0, d1 = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    be = create_rollout_backend("native", d0, max_num_seqs=8, max_model_len=128)
    fresh = create_rollout_backend("native", d1, max_num_seqs=8, max_model_len=128)
    prompts = _prompts(3, seed=10)
    sps = [
        SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=i)
        for i in range(3)
    ]
    before = _gen(be, prompts, sps)
    be.update_weights(
        _hf(d1).named_parameters()
    )  # an actor's per-tensor stream (tied lm_head omitted)
    after, ref = _gen(be, prompts, sps), _gen(fresh, prompts, sps)
    assert (
        [o.token_ids for o in after] == [o.token_ids for o in ref] != [o.token_ids for o in before]
    )
    for a, r in zip(after, ref):
        assert a.log_probs == r.log_probs
    with pytest.raises(KeyError, match="unknown parameter"):
        be.update_weights([("model.nope.weight", torch.zeros(1))])


def test_sleep_aborts_and_wake_restores(tiny_model_dir):
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=512)
    prompt = _prompts(1, seed=11)[0]
    ref = _gen(be, [prompt], [GREEDY])[0]

    async def run():
        task = asyncio.create_task(
            be.generate(
                prompt, SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True), "x"
            )
        )
        while be.num_running == 0 or int(be.s_ngen[0]) < 2:
            await asyncio.sleep(0.005)
        be.sleep()
        out = await asyncio.wait_for(task, 30)
        queued = asyncio.create_task(be.generate(prompt, GREEDY, "y"))
        await asyncio.sleep(0.05)
        assert not queued.done()  # waits while asleep
        be.wake_up()
        return out, await asyncio.wait_for(queued, 30)

    aborted, after = asyncio.run(run())
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) >= 2
    assert after.token_ids == ref.token_ids


def test_bad_requests_raise(backend):
    with pytest.raises(RolloutError, match="max_model_len"):
        _gen(backend, [[1] * 300], [GREEDY])
    with pytest.raises(RolloutError, match="empty"):
        _gen(backend, [[]], [GREEDY])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_import_is_lazy():
    code = (
        "import sys, postrl.rollout; "
        "bad = [m for m in ('vllm', 'sglang', 'postrl.rollout.native.engine', 'transformers') "
        "if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert {"native", "hf", "vllm", "sglang"} <= set(ROLLOUT_BACKENDS.names())


@pytest.mark.parametrize("name,extra", [("vllm", "postrl[vllm]"), ("sglang", "postrl[sglang]")])
def test_gpu_backends_say_which_extra(tiny_model_dir, name, extra):
    pytest.importorskip("torch")
    try:
        __import__(name)
    except ImportError:
        with pytest.raises(ImportError, match=extra.replace("[", r"\[").replace("]", r"\]")):
            create_rollout_backend(name, tiny_model_dir)
    else:
        pytest.skip(f"{name} is installed")


def test_engine_failure_fails_requests_then_recovers(tiny_model_dir):
    from postrl.rollout import RolloutError

    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=64)
    good = be._admit

    def boom(new):
        raise RuntimeError("injected prefill failure")

    be._admit = boom
    with pytest.raises(RolloutError, match="injected"):
        _gen(be, [[1, 2, 3]] * 3, [GREEDY] * 3)
    be._admit = good
    out = _gen(be, [[1, 2, 3]], [GREEDY])[0]
    assert len(out.token_ids) == 12 and be.num_running == 0 and be.kv.num_prefixes == 0


def test_waiting_requests_are_admitted_by_priority_then_arrival(tiny_model_dir):
    """One slot: requests queued while it is busy are admitted lowest priority first, in
    arrival order within a priority (an async mode's interrupted older trajectory resumes
    before the next batch's fresh requests)."""
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=1, max_model_len=256)
    prompt = _prompts(1, seed=11)[0]
    order: list[str] = []

    async def one(rid: str, priority: int) -> None:
        sp = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, priority=priority)
        await be.generate(prompt, sp, rid)
        order.append(rid)

    async def run():
        first = asyncio.create_task(one("busy", 0))
        await asyncio.sleep(0)  # "busy" takes the only slot
        rest = [
            asyncio.create_task(one(r, p))
            for r, p in [("new-a", 5), ("new-b", 5), ("old-a", 4), ("newest", 6), ("old-b", 4)]
        ]
        await asyncio.gather(first, *rest)

    asyncio.run(run())
    assert order == ["busy", "old-a", "old-b", "new-a", "new-b", "newest"]


def test_continuation_shares_the_prompt_and_equals_the_uninterrupted_run(tiny_model_dir):
    """A continued request (``SamplingParams.continued``) returns exactly the tokens and
    log-probs the uninterrupted greedy run sampled after its partial, the continuations of one
    prompt share one prefill, and a continuation replayed into a running batch leaves the other
    requests' outputs unchanged."""
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=16, max_model_len=128)
    prompt, other = _prompts(2, seed=11, lo=8, hi=16)
    full = _gen(be, [prompt], [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)])[
        0
    ]
    cuts = [1, 1, 3, 7]
    sps = [
        SamplingParams(temperature=0, max_new_tokens=20 - k, ignore_eos=True, continued=k)
        for k in cuts
    ]
    long_sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    alone = _gen(be, [other], [long_sp])[0]
    prefilled: list[tuple[int, ...]] = []  # the prompts the engine prefills
    orig = be._prefill
    be._prefill = lambda rows: (prefilled.extend(be.kv.keys[r] for r in rows), orig(rows))[1]

    async def run():
        first = asyncio.create_task(be.generate(other, long_sp, "running"))
        for _ in range(2000):  # the continuations join a batch that is mid-way
            await asyncio.sleep(0.002)
            if be.num_running and int(be.s_ngen[0]) >= 4:
                break
        conts = [
            be.generate(prompt + full.token_ids[:k], s, f"c{i}")
            for i, (k, s) in enumerate(zip(cuts, sps))
        ]
        return await first, await asyncio.gather(*conts)

    try:
        running, conts = asyncio.run(run())
    finally:
        be._prefill = orig
    assert prefilled == [tuple(other), tuple(prompt)]  # one prefill for the four continuations
    assert running.token_ids == alone.token_ids
    torch.testing.assert_close(
        torch.tensor(running.log_probs), torch.tensor(alone.log_probs), atol=1e-5, rtol=0
    )
    for k, out in zip(cuts, conts):
        assert out.token_ids == full.token_ids[k:] and out.finish_reason == "length"
        assert out.versions == [(20 - k, 0)]
        torch.testing.assert_close(
            torch.tensor(out.log_probs), torch.tensor(full.log_probs[k:]), atol=1e-4, rtol=0
        )
