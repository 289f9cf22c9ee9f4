"""FSDP2 data parallelism (``strategy=fsdp2``) on dp=2 Ray/gloo workers against dp=1 local ones.

One local dp=1 actor group and one Ray dp=2 FSDP2 actor group live for the module and see the
same sequence of calls, in file order. Each mini-batch is 2 prompts × 4 responses = 8 rows, so a
16-row batch is two optimizer steps. The dp dispatch gives rank r rows ``8r … 8r+7`` and each
rank splits its half into mini-batches of 4: global mini-batch k = rows ``4k…4k+3`` of both
halves. The dp=1 group gets the rows permuted so that its mini-batch k holds exactly those rows
(:data:`DP1_ORDER`); then both must take the same two steps (float tolerance).

As in ``test_dp.py``, ``optim.eps`` ≫ |g| makes AdamW ≈ SGD with lr/eps (here lr/eps = 1 for
the actor: one step moves a weight by about its gradient) so equal updates are testable tightly.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

ray = pytest.importorskip("ray")

from postrl.config import load_config  # noqa: E402
from postrl.controller import create_worker_group  # noqa: E402
from postrl.engine.checkpoint import export_hf  # noqa: E402
from postrl.protocol import DataProto  # noqa: E402
from postrl.weights import FrameStream  # noqa: E402
from postrl.workers import ActorWorker, CriticWorker, RefWorker  # noqa: E402

pytestmark = pytest.mark.ray

DP1_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
"""Row order for dp=1 whose two mini-batches equal the dp=2 ones (see the module docstring)."""


def _cfg(model_dir):
    return load_config(None, _overrides(model_dir))


def _overrides(model_dir) -> list[str]:
    return [
        f"model.path={model_dir}",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_epochs=1",
        "actor.optim.lr=1000.0",
        "actor.optim.eps=1000.0",
        "actor.optim.grad_clip=1e6",
        "actor.entropy_coeff=0.01",
        "actor.ppo_max_token_len_per_gpu=32",
        "actor.strategy=fsdp2",
        "critic.ppo_mini_batch_size=2",
        "critic.ppo_epochs=2",
        "critic.optim.lr=10.0",
        "critic.optim.eps=1000.0",
        "critic.optim.grad_clip=1e6",
        "critic.ppo_max_token_len_per_gpu=32",
        "critic.strategy=fsdp2",
        "trainer.num_threads=1",
    ]


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    """(local dp=1 actor group, ray dp=2 fsdp2 actor group, config)."""
    cfg = _cfg(tiny_model_dir)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    local = ray_wg = None
    try:
        local = create_worker_group(
            "local", ActorWorker, kwargs={"cfg": cfg, "total_steps": 8}, name="fsdp_dp1"
        )
        ray_wg = create_worker_group(
            "ray",
            ActorWorker,
            kwargs={"cfg": cfg, "total_steps": 8},
            world_size=2,
            name="fsdp_dp2",
            init_dist=True,
            shutdown_on_error=False,
        )
        yield local, ray_wg, cfg
    finally:
        for g in (local, ray_wg):
            if g is not None:
                g.shutdown()
        ray.shutdown()


def _frames(wg) -> list[tuple[str, torch.Tensor]]:
    return [(k, v.clone()) for k, v in FrameStream.from_actor(wg).tensors()]


def _local(wg) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in wg.get_per_tensor_param()}


def _batch(make_batch, seed: int) -> DataProto:
    b = make_batch(num_prompts=4, n=4, seed=seed)
    b.batch["old_log_probs"] = 0.05 * b.batch["response_mask"]  # ratios ≠ 1
    return b


def _assert_same_update(m1: dict, m2: dict, w1: dict, w2: dict, before: dict) -> None:
    assert set(m1) == set(m2)
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4, (
        f"the update barely moved the weights ({moved}); the comparison would be vacuous"
    )
    for k in w1:
        torch.testing.assert_close(
            w2[k], w1[k], atol=1e-6, rtol=1e-5, msg=lambda s, k=k: f"{k}: {s}"
        )


def test_params_are_sharded(groups):
    local, ray_wg, _ = groups
    full = local.shard_stats()[0]["full"]
    stats = ray_wg.shard_stats()
    for s in stats:
        assert s["full"] == full
        # dim-0 halves (odd dims padded by FSDP2): each rank stores about half of every parameter
        assert abs(s["local"] - full / 2) <= 0.01 * full, stats
    assert local.shard_stats()[0]["local"] == full


def test_weight_frames_are_full_hf_tensors(groups):
    local, ray_wg, _ = groups
    got = _frames(ray_wg)
    names = [n for n, _ in got]
    assert len(names) == len(set(names)), "a tensor was yielded twice"
    ref = _local(local)
    assert set(names) == set(ref)
    for n, t in got:
        assert t.shape == ref[n].shape, n
        assert torch.equal(t, ref[n]), n  # same init, gathered exactly


def test_get_per_tensor_param_refuses_sharded_group(groups):
    _, ray_wg, _ = groups
    with pytest.raises(Exception, match="open_weight_stream"):
        ray_wg.get_per_tensor_param()


def test_log_probs_and_two_minibatch_update_match_dp1(groups, make_batch):
    local, ray_wg, _ = groups
    batch = _batch(make_batch, seed=21)
    lp1 = local.compute_log_prob(batch).batch["old_log_probs"]
    lp2 = ray_wg.compute_log_prob(batch).batch["old_log_probs"]
    torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=1e-5)

    before = _local(local)
    m1 = local.update_actor(batch[DP1_ORDER]).meta_info["metrics"]
    m2 = ray_wg.update_actor(batch).meta_info["metrics"]
    _assert_same_update(m1, m2, _local(local), dict(_frames(ray_wg)), before)


def test_fused_on_policy_update_matches_dp1(groups, make_batch):
    """Without old_log_probs and with one mini-batch (8 rows), dp=2 FSDP2 fuses the old log-probs
    into the update like dp=1, takes the same step, and returns them row-aligned with the batch."""
    local, ray_wg, _ = groups
    batch = make_batch(num_prompts=2, n=4, seed=23)
    lp = local.compute_log_prob(batch).batch["old_log_probs"]
    before = _local(local)
    out1, out2 = local.update_actor(batch), ray_wg.update_actor(batch)
    torch.testing.assert_close(out1.batch["old_log_probs"], lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2.batch["old_log_probs"], lp, atol=1e-5, rtol=1e-5)
    m1, m2 = out1.meta_info["metrics"], out2.meta_info["metrics"]
    assert m1["actor/ppo_kl"] == 0.0 == m2["actor/ppo_kl"]
    _assert_same_update(m1, m2, _local(local), dict(_frames(ray_wg)), before)


def test_nonfinite_grad_skips_on_every_rank(groups, make_batch):
    local, ray_wg, _ = groups
    bad = _batch(make_batch, seed=22)
    adv = bad.batch["advantages"].clone()
    adv[12] = float("nan")  # a row of rank 1's half only: rank 0's local gradient is finite
    bad.batch["advantages"] = adv
    before = dict(_frames(ray_wg))
    m1 = local.update_actor(bad[DP1_ORDER]).meta_info["metrics"]
    m2 = ray_wg.update_actor(bad).meta_info["metrics"]
    assert m1["actor/grad_norm_nonfinite_skips"] == m2["actor/grad_norm_nonfinite_skips"] == 1.0
    after = dict(_frames(ray_wg))
    for k in before:  # the step with the NaN row was skipped; the other mini-batch still stepped
        assert torch.isfinite(after[k]).all(), k
    # every rank skipped the same step: the next update still equals dp=1
    good = _batch(make_batch, seed=23)
    ref_before = _local(local)
    m1 = local.update_actor(good[DP1_ORDER]).meta_info["metrics"]
    m2 = ray_wg.update_actor(good).meta_info["metrics"]
    _assert_same_update(m1, m2, _local(local), dict(_frames(ray_wg)), ref_before)


def test_checkpoint_resume_identical_next_step(groups, make_batch, tmp_path):
    """save (sharded) → next step A → load → next step B: A == B bit for bit; the checkpoint is
    full-tensor, so dp=1 loads it too and ``export_hf`` reads it."""
    local, ray_wg, cfg = groups
    ck = tmp_path / "ck"
    ray_wg.save_checkpoint(str(ck))
    saved = dict(_frames(ray_wg))
    b = _batch(make_batch, seed=24)
    m_a = ray_wg.update_actor(b).meta_info["metrics"]
    w_a = dict(_frames(ray_wg))
    ray_wg.load_checkpoint(str(ck))
    for k, t in _frames(ray_wg):
        assert torch.equal(t, saved[k]), k
    m_b = ray_wg.update_actor(b).meta_info["metrics"]
    w_b = dict(_frames(ray_wg))
    assert m_a == m_b
    for k in w_a:
        assert torch.equal(w_a[k], w_b[k]), k

    local.load_checkpoint(str(ck))  # fsdp2 dp=2 checkpoint → dp=1: same next step
    m_1 = local.update_actor(b[DP1_ORDER]).meta_info["metrics"]
    _assert_same_update(m_1, m_a, w_a, _local(local), saved)

    out = export_hf(ck, tmp_path / "hf")
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    for k, t in saved.items():
        assert torch.equal(exported[k], t), k


def test_lora_fsdp2_matches_dp1(tiny_model_dir, groups, make_batch):
    """LoRA adapters on an FSDP2-sharded model: dp=2 takes dp=1's update (merged weights streamed
    from the shards equal dp=1's), and the LoRA reference (adapters off) is the base model."""
    # lr/eps = 20: the merged LoRA delta (alpha/r)·B·A of one step is small next to a
    # full-weight step
    cfg = load_config(
        None,
        [
            *_overrides(tiny_model_dir),
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "actor.optim.lr=20000.0",
        ],
    )
    with _dp1_and_sharded_dp2(ActorWorker, cfg, "lora", total_steps=8) as (g1, g2):
        before = dict(_frames(g1))
        batch = _batch(make_batch, seed=30)
        lp1 = g1.compute_log_prob(batch).batch["old_log_probs"]
        lp2 = g2.compute_log_prob(batch).batch["old_log_probs"]
        torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=1e-5)
        m1 = g1.update_actor(batch[DP1_ORDER]).meta_info["metrics"]
        m2 = g2.update_actor(batch).meta_info["metrics"]
        _assert_same_update(m1, m2, dict(_frames(g1)), dict(_frames(g2)), before)
        ref1 = g1.compute_ref_log_prob(batch).batch["ref_log_prob"]
        ref2 = g2.compute_ref_log_prob(batch).batch["ref_log_prob"]
        torch.testing.assert_close(ref2, ref1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ref1, lp1, atol=1e-5, rtol=1e-5
        )  # adapters off = the untrained base


def test_reward_model_fsdp2_matches_dp1(tiny_model_dir, groups, make_batch, tmp_path):
    """The reward model is FSDP2-sharded on dp=2 (half the weights per rank) and scores like
    dp=1."""
    from postrl.testing import make_model
    from postrl.workers import RewardModelWorker

    rm_dir = make_model(tmp_path / "rm", head="reward", seed=5)
    cfg = load_config(
        None,
        [
            *_overrides(tiny_model_dir),
            "reward.model.enable=true",
            f"reward.model.path={rm_dir}",
            "reward.model.micro_batch_size=3",
        ],
    )
    with _dp1_and_sharded_dp2(RewardModelWorker, cfg, "rmw") as (w1, w2):
        b = make_batch(num_prompts=4, n=4, seed=31)
        msgs = [[{"role": "user", "content": f"question {i // 4}"}] for i in range(len(b))]
        b = b.union(DataProto.from_dict(non_tensors={"messages": msgs}))
        s1, s2 = (
            w1.compute_rm_score(b).batch["rm_scores"],
            w2.compute_rm_score(b).batch["rm_scores"],
        )
        assert float(s1.std()) > 0
        torch.testing.assert_close(s2, s1, atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_format(tiny_model_dir, groups, make_batch, tmp_path):
    """trainer.checkpoint_format=sharded: each rank writes its own half (no full copy anywhere);
    same-dp resume reads only the own files and reproduces the next step bit for bit; dp=1
    resumes from the merged shards with the same next step; export merges them into HF weights."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cfg = load_config(None, [*_overrides(tiny_model_dir), "trainer.checkpoint_format=sharded"])
    with _dp1_and_sharded_dp2(ActorWorker, cfg, "shck", total_steps=8) as (g1, g2):
        g2.update_actor(_batch(make_batch, seed=28))  # non-trivial AdamW moments
        ck = tmp_path / "ck"
        g2.save_checkpoint(str(ck))
        assert sorted(f.name for f in ck.iterdir()) == [
            "model-rank00000.safetensors",
            "model-rank00001.safetensors",
            "optim-rank00000.safetensors",
            "optim-rank00001.safetensors",
            "rng.safetensors",
            "state.json",
        ]
        saved = dict(_frames(g2))
        full = sum(t.numel() for t in saved.values())
        for r in (0, 1):
            with safe_open(str(ck / f"model-rank0000{r}.safetensors"), "pt") as f:
                n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
            assert abs(n - full / 2) <= 0.02 * full, f"rank {r} file holds {n} of {full} elements"

        b = _batch(make_batch, seed=29)
        m_a = g2.update_actor(b).meta_info["metrics"]
        w_a = dict(_frames(g2))
        g2.load_checkpoint(str(ck))
        for k, t in _frames(g2):
            assert torch.equal(t, saved[k]), k
        m_b = g2.update_actor(b).meta_info["metrics"]
        assert m_a == m_b
        for k, t in _frames(g2):
            assert torch.equal(t, w_a[k]), k

        g1.load_checkpoint(str(ck))  # dp=1 from the merged shards: the same next step
        m_1 = g1.update_actor(b[DP1_ORDER]).meta_info["metrics"]
        _assert_same_update(m_1, m_a, w_a, _local(g1), saved)

        exported = load_file(str(export_hf(ck, tmp_path / "hf") / "model.safetensors"))
        for k, t in saved.items():
            assert torch.equal(exported[k], t), k


@contextlib.contextmanager
def _dp1_and_sharded_dp2(worker_cls, cfg, name: str, **kwargs):
    """A local dp=1 group and a Ray dp=2 FSDP2 group of ``worker_cls`` (checked sharded); shut
    down after."""
    g1 = create_worker_group("local", worker_cls, kwargs={"cfg": cfg, **kwargs}, name=f"{name}_dp1")
    g2 = None
    try:
        g2 = create_worker_group(
            "ray",
            worker_cls,
            kwargs={"cfg": cfg, **kwargs},
            world_size=2,
            name=f"{name}_dp2",
            init_dist=True,
        )
        assert all(abs(s["local"] - s["full"] / 2) <= 0.01 * s["full"] for s in g2.shard_stats())
        yield g1, g2
    finally:
        for g in (g1, g2):
            if g is not None:
                g.shutdown()


def test_ref_worker_fsdp2_matches_dp1(groups, make_batch):
    """The frozen reference model is sharded too (``actor.strategy``) and gives dp=1's log-probs."""
    _, _, cfg = groups
    with _dp1_and_sharded_dp2(RefWorker, cfg, "ref") as (r1, r2):
        batch = make_batch(num_prompts=4, n=4, seed=26)
        lp1 = r1.compute_ref_log_prob(batch).batch["ref_log_prob"]
        lp2 = r2.compute_ref_log_prob(batch).batch["ref_log_prob"]
        assert float(lp1.abs().max()) > 0
        torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=1e-5)


def test_critic_fsdp2_matches_dp1(groups, make_batch):
    _, _, cfg = groups
    with _dp1_and_sharded_dp2(CriticWorker, cfg, "critic") as (c1, c2):
        batch = make_batch(num_prompts=4, n=4, seed=25)
        batch = batch.union(c1.compute_values(batch))
        batch.batch["returns"] = torch.linspace(-1, 1, batch.batch["values"].numel()).view_as(
            batch.batch["values"]
        )
        batch.batch["returns"] = batch.batch["returns"] * batch.batch["response_mask"]
        m1 = c1.update_critic(batch[DP1_ORDER]).meta_info["metrics"]
        m2 = c2.update_critic(batch).meta_info["metrics"]
        for k in m1:
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
        v1 = c1.compute_values(batch).batch["values"]
        v2 = c2.compute_values(batch).batch["values"]
        assert float(v1.abs().max()) > 1e-3  # the updates moved the values (comparison not vacuous)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-4)


def test_mixed_precision_fsdp2_bf16_compute(tiny_model_dir, groups, make_batch):
    """model.compute_dtype=bfloat16 on dp=2 FSDP2 (MixedPrecisionPolicy: bf16 gathers and math,
    fp32 shards and gradient reduction) vs dp=1 with autocast and vs plain fp32 dp=1: log-probs
    within bf16 rounding of fp32 (and not equal: the casting took effect), an update in the same
    direction as fp32's, and weights that stay fp32."""
    cfg = load_config(None, [*_overrides(tiny_model_dir), "model.compute_dtype=bfloat16"])
    fp32 = create_worker_group(
        "local", ActorWorker, kwargs={"cfg": _cfg(tiny_model_dir), "total_steps": 8}, name="mp_fp32"
    )
    try:
        with _dp1_and_sharded_dp2(ActorWorker, cfg, "mp", total_steps=8) as (auto1, mp2):
            batch = _batch(make_batch, seed=27)
            lp0 = fp32.compute_log_prob(batch).batch["old_log_probs"]
            lp1 = auto1.compute_log_prob(batch).batch["old_log_probs"]
            lp2 = mp2.compute_log_prob(batch).batch["old_log_probs"]
            mask = batch.batch["response_mask"].bool()
            for name, lp in (("dp=1 autocast", lp1), ("dp=2 FSDP2", lp2)):
                err = float((lp - lp0)[mask].abs().max())
                assert 1e-4 < err < 0.1, (
                    f"{name}: max |log-prob - fp32| = {err} (bf16 rounding is ~1e-3)"
                )
            before = _local(fp32)
            fp32.update_actor(batch[DP1_ORDER])
            mp2.update_actor(batch)
            after0, after2 = _local(fp32), dict(_frames(mp2))
            assert all(t.dtype == torch.float32 for t in after2.values())
            d0 = torch.cat([(after0[k] - before[k]).flatten() for k in sorted(before)])
            d2 = torch.cat([(after2[k] - before[k]).flatten() for k in sorted(before)])
            cos = float(torch.nn.functional.cosine_similarity(d0, d2, dim=0))
            assert cos > 0.95, f"the bf16 update points elsewhere than fp32's (cosine {cos:.3f})"
    finally:
        fp32.shutdown()


def test_strategy_is_validated():
    from postrl.config import ConfigError
    from postrl.config.schema import PostRLConfig
    from postrl.config.validate import validate_config

    cfg = PostRLConfig()
    cfg.actor.strategy, cfg.critic.strategy = "fsdp", "zero3"
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False, check_registries=False)
    assert "actor.strategy='fsdp' must be 'fsdp2'" in str(e.value)
    assert "critic.strategy='zero3' must be 'fsdp2'" in str(e.value)
