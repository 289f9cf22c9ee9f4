"""Weights swapped into the native engine while requests run: nothing is aborted, every token
carries the version of the weights that sampled it, and (``swap_kv="recompute"``) its log-prob is
the teacher-forced log-prob of exactly those weights over the whole sequence.

Oracle: a plain transformers forward (fp32) of prompt + all tokens under each version's weights;
token ``t`` tagged version ``v`` must have ``log_softmax(logits_v / T)[t]`` at its position.
Tolerance ``TOL = 1e-4`` absolute (the engine and transformers sum in different orders and BLAS
differs across machines, so bit equality is never asserted); the perturbations between versions
move log-probs by far more (asserted, so the check has power).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from postrl.rollout import RolloutReplica, SamplingParams, create_rollout_backend
from postrl.weights import encode_frame, pack_buckets

TOL = 1e-4
TEMP = 1.0
BUCKET_BYTES = 1 << 18  # the tiny model (~2.4M fp32 params) travels in ~10 buckets
GROUPS, SAMPLES = 3, 8  # 3 distinct prompts x 8 samples = 24 requests in flight
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], [1, 4, 1, 4, 2]]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _versions(model, n: int) -> list[dict[str, torch.Tensor]]:
    """Version 0 = the checkpoint; version k = the checkpoint + independent N(0, 0.02²) noise."""
    base = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = [base]
    for k in range(1, n):
        g = torch.Generator().manual_seed(1000 + k)
        out.append({name: t + 0.02 * torch.randn(t.shape, generator=g) for name, t in base.items()})
    return out


def _ref_logprobs(model, weights: dict[str, torch.Tensor], prompt, tokens) -> torch.Tensor:
    """Teacher-forced ``log_softmax(logits / T)`` of ``tokens`` after ``prompt`` under ``weights``
    (copied into ``model``; tied lm_head follows the embedding). Returns (len(tokens),)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / TEMP, -1)  # (N, V)
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _count_steps(be) -> list[int]:
    """Wrap the engine's step so the test can pace itself on engine steps."""
    count, step = [0], be._step

    def counted():
        count[0] += 1
        return step()

    be._step = counted
    return count


async def _until(cond, tasks=(), limit: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        assert loop.time() < deadline, "condition never met"
        assert not tasks or not all(t.done() for t in tasks), "requests finished too early"
        await asyncio.sleep(0)


def _expand(segments: list[tuple[int, int]]) -> list[int]:
    return [v for n, v in segments for _ in range(n)]


def _swap_run(be, versions, swap_every: int = 8):
    """24 seeded requests (3 prompts x 8, 30-40 new tokens, group g admitted after 2g steps),
    with ``len(versions) - 1`` swaps every ``swap_every`` engine steps (the 4th lands after the
    first requests finished and their slots were compacted), each sent bucket by bucket through
    ``receive_bucket`` from a concurrent task, yielding to the engine loop between buckets.
    Returns (requests, outputs, per-swap metrics, buckets per swap)."""
    replica = RolloutReplica(be)
    steps = _count_steps(be)
    reqs = [
        (
            PROMPTS[g],
            SamplingParams(
                temperature=TEMP,
                max_new_tokens=30 + (g * SAMPLES + i) % 11,
                ignore_eos=True,
                seed=100 * g + i,
            ),
        )
        for g in range(GROUPS)
        for i in range(SAMPLES)
    ]
    metrics: list[dict[str, float]] = []
    buckets: list[int] = []

    async def swapper(tasks):
        for k in range(1, len(versions)):
            await _until(lambda k=k: steps[0] >= swap_every * k, tasks)
            frames = [encode_frame(b) for b in pack_buckets(versions[k].items(), BUCKET_BYTES, k)]
            at_first = None
            for frame in frames:
                if frame is frames[-1]:
                    assert steps[0] == at_first, "the engine stepped on half-updated weights"
                replica.receive_bucket(frame)
                at_first = steps[0] if at_first is None else at_first
                await asyncio.sleep(0)  # the engine loop gets the thread between buckets
            assert replica.policy_version == k and be.weight_version == k
            metrics.append(dict(replica.last_swap))
            buckets.append(len(frames))

    async def run():
        tasks = []
        for g in range(GROUPS):
            await _until(lambda g=g: steps[0] >= 2 * g)
            tasks += [
                asyncio.create_task(replica.generate(p, sp, f"g{g}s{i}"))
                for i, (p, sp) in enumerate(reqs[g * SAMPLES : (g + 1) * SAMPLES])
            ]
        swap = asyncio.create_task(swapper(tasks))
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        await asyncio.wait_for(swap, 120)
        return outs

    outs = asyncio.run(run())
    return reqs, outs, metrics, buckets


def _check_tagging(reqs, outs) -> None:
    """Nothing aborted; segments cover every token; versions never go back; some span ≥ 2."""
    spanning = 0
    for (_, sp), o in zip(reqs, outs, strict=True):
        assert o.finish_reason == "length"
        assert len(o.token_ids) == sp.max_new_tokens == len(o.log_probs)
        assert sum(n for n, _ in o.versions) == len(o.token_ids)
        assert all(n > 0 for n, _ in o.versions)
        vs = [v for _, v in o.versions]
        assert vs == sorted(vs)
        spanning += len(vs) >= 2
    assert spanning >= len(outs) // 2


@pytest.fixture(scope="module")
def hf_and_versions(tiny_model_dir):
    model = _hf(tiny_model_dir)
    return model, _versions(model, 5)


@pytest.mark.parametrize("path", ["step", "fused", "torch"])
def test_swaps_mid_request_keep_exact_versions_and_logprobs(tiny_model_dir, hf_and_versions, path):
    """4 swaps (4 different weight sets) while 24 requests run: every token's log-prob equals
    the teacher-forced log-prob of the version it is tagged with, and differs from that of the
    previous version (the check can tell versions apart)."""
    model, versions = hf_and_versions
    be = create_rollout_backend(
        "native",
        tiny_model_dir,
        max_num_seqs=24,
        max_model_len=128,
        kernels="torch" if path == "torch" else "auto",
    )
    if path != "torch" and be.kernels is None:
        pytest.skip("fused CPU kernels unavailable on this machine")
    be.kernels_step = path == "step"
    if path == "step" and be._decode_step() is None:
        pytest.skip("whole-step C decode unavailable (torch's sgemm_ not resolved)")
    reqs, outs, metrics, buckets = _swap_run(be, versions)

    _check_tagging(reqs, outs)
    assert len(metrics) == 4 and min(buckets) >= 3  # several buckets per update
    assert max(m["running"] for m in metrics) > 0
    assert metrics[0]["running"] == 24 > metrics[-1]["running"]  # the last swap after finishes
    assert all(0 <= m["recompute_s"] <= m["pause_s"] for m in metrics)
    worst, separation = 0.0, []
    for (prompt, _), o in zip(reqs, outs, strict=True):
        tags = torch.tensor(_expand(o.versions))  # (N,) version of each token
        lp = torch.tensor(o.log_probs)
        for v in tags.unique().tolist():
            at = tags == v
            ref = _ref_logprobs(model, versions[v], prompt, o.token_ids)
            worst = max(worst, (ref - lp)[at].abs().max().item())
            if v > 0:
                prev = _ref_logprobs(model, versions[v - 1], prompt, o.token_ids)
                separation.append((prev - lp)[at].abs().max().item())
    assert worst < TOL, f"max |log-prob - teacher-forced| = {worst:.2e}"
    assert separation and min(separation) > 100 * TOL


def test_keep_kv_tags_versions_and_old_tokens_match_old_weights(tiny_model_dir, hf_and_versions):
    """``swap_kv="keep"``: versions are tagged as with recompute; tokens sampled before the first
    swap are exactly the old weights'; after it they come from stale K/V (a mixed forward), which
    no single version's teacher-forced forward reproduces."""
    model, versions = hf_and_versions
    be = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=24, max_model_len=128, swap_kv="keep"
    )
    reqs, outs, metrics, _ = _swap_run(be, versions[:3])
    _check_tagging(reqs, outs)
    assert all(m["recompute_s"] == pytest.approx(0.0, abs=1e-3) for m in metrics)
    worst_old, stale = 0.0, 0.0
    for (prompt, _), o in zip(reqs, outs, strict=True):
        tags = torch.tensor(_expand(o.versions))
        lp = torch.tensor(o.log_probs)
        ref0 = _ref_logprobs(model, versions[0], prompt, o.token_ids)
        worst_old = max(worst_old, (ref0 - lp)[tags == 0].abs().max().item())
        for v in set(tags.tolist()) - {0}:
            ref = _ref_logprobs(model, versions[v], prompt, o.token_ids)
            stale = max(stale, (ref - lp)[tags == v].abs().max().item())
    assert worst_old < TOL
    assert stale > 100 * TOL  # documented: after a "keep" swap, log-probs are not the new weights'


@pytest.mark.parametrize("threaded", [False, True])
def test_held_engine_does_not_step(tiny_model_dir, threaded):
    """Between begin/end no step runs (the driver parks instead of spinning): running slots keep
    their token counts, a new request waits; after ``end_weight_swap`` everything finishes, each
    request split exactly where the swap happened."""
    be = create_rollout_backend(
        "native", tiny_model_dir, max_num_seqs=8, max_model_len=128, threaded=threaded
    )
    steps = _count_steps(be)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7)

    async def run():
        tasks = [asyncio.create_task(be.generate(PROMPTS[i % 2], sp, f"h{i}")) for i in range(4)]
        await _until(lambda: steps[0] >= 4 and be.num_running == 4, tasks)
        be.begin_weight_swap()
        held_ngen = {r.request_id: int(n) for r, n in zip(be._slots, be.s_ngen[:4].tolist())}
        late = asyncio.create_task(be.generate(PROMPTS[2], sp, "late"))
        await asyncio.sleep(0.02)  # a threaded step dispatched before begin returns as a no-op
        held_steps = steps[0]
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert steps[0] == held_steps  # parked, not spinning on a no-op step
        assert {r.request_id: int(n) for r, n in zip(be._slots, be.s_ngen[:4].tolist())} == (
            held_ngen
        )
        assert be.num_running == 4 and be.num_waiting == 1
        assert not any(t.done() for t in [*tasks, late])
        metrics = be.end_weight_swap()  # same weights, version 0 -> 1
        outs = await asyncio.wait_for(asyncio.gather(*tasks, late), 60)
        return held_ngen, metrics, outs

    held_ngen, metrics, outs = asyncio.run(run())
    assert metrics["running"] == 4 and metrics["pause_s"] >= 0.09
    for i, o in enumerate(outs[:4]):
        assert o.finish_reason == "length" and len(o.token_ids) == 24
        assert o.versions == [(held_ngen[f"h{i}"], 0), (24 - held_ngen[f"h{i}"], 1)]
    assert outs[4].versions == [(24, 1)]
    be.close()


def test_replica_update_weights_swaps_without_abort(tiny_model_dir, hf_and_versions):
    """``RolloutReplica.update_weights`` with no pause: in-flight requests continue on the new
    weights with exact log-probs; a bad bucket closes its swap, keeps the version and raises."""
    model, versions = hf_and_versions
    be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=4, max_model_len=128)
    replica = RolloutReplica(be)
    steps = _count_steps(be)
    sp = SamplingParams(temperature=TEMP, max_new_tokens=30, ignore_eos=True, seed=3)

    async def run():
        task = asyncio.create_task(replica.generate(PROMPTS[0], sp, "u"))
        await _until(lambda: steps[0] >= 8, [task])
        replica.update_weights(versions[1].items(), version=5)
        return await asyncio.wait_for(task, 60)

    out = asyncio.run(run())
    assert out.finish_reason == "length" and [v for _, v in out.versions] == [0, 5]
    assert replica.last_swap["running"] == 1 and be.weight_version == replica.policy_version == 5
    tags = torch.tensor(_expand(out.versions))
    lp = torch.tensor(out.log_probs)
    for v, w in [(0, versions[0]), (5, versions[1])]:
        ref = _ref_logprobs(model, w, PROMPTS[0], out.token_ids)
        assert (ref - lp)[tags == v].abs().max().item() < TOL

    bad = encode_frame(next(iter(pack_buckets([("model.nope.weight", torch.zeros(2))]))))
    with pytest.raises(KeyError, match="unknown parameter"):
        replica.receive_bucket(bad)
    assert not be.weight_swap_open and replica.policy_version == be.weight_version == 5
