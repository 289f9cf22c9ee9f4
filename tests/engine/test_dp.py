"""Data parallelism: an actor update on dp=2 (Ray, gloo) equals the same update on dp=1 (local).

Gradients are SUMMED over ranks and every loss term uses the mini-batch's GLOBAL denominators,
so two ranks each holding half of a mini-batch must produce the weights one rank produces from
the whole mini-batch — up to float reduction order. The groups live for the whole module and
see the same sequence of updates, so optimizer state is compared too, not just one step.

Both strategies are run: ``ddp`` (replicas + summed all-reduce) and ``fsdp2`` (FSDP2 shards,
SUM reduce-scatter). The token budget (32) gives several micro-batches per rank, so under FSDP2
the ranks' micro-batch counts must be aligned (split, and dummy passes where a rank has a single
placeholder row).

Adam's first steps are ≈ lr·sign(g): float noise on a ~0 gradient becomes a ±lr step. The test
sets ``optim.eps`` ≫ |g| so AdamW behaves like SGD with lr/eps (update ≈ lr·g/eps) and
"same update" is testable tightly (the engine tests swap in SGD for the same reason).
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from postrl.config import load_config  # noqa: E402
from postrl.controller import create_worker_group  # noqa: E402
from postrl.engine.minibatch import pad_masked_rows  # noqa: E402
from postrl.protocol import DataProto  # noqa: E402
from postrl.weights import FrameStream  # noqa: E402
from postrl.workers import ActorWorker  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    """A 2-CPU local Ray cluster for the module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["ddp", "fsdp2", "fsdp2_skip"])
def groups(request, ray_cluster, tiny_model_dir):
    """(local dp=1 actor group, ray dp=2 actor group with ``actor.strategy=<param>``) from one
    config; ``fsdp2_skip``: with ``actor.skip_zero_advantage`` (the masked and zero-advantage
    rows leave the passes; a rank left with none runs one row masked, to stay in step)."""
    strategy, _, skip = request.param.partition("_")
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "rollout.n=4",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
            "actor.optim.lr=10.0",
            "actor.optim.eps=1000.0",
            "actor.optim.grad_clip=1e6",
            "actor.entropy_coeff=0.01",
            "actor.ppo_max_token_len_per_gpu=32",
            f"actor.strategy={strategy}",
            f"actor.skip_zero_advantage={'true' if skip else 'false'}",
            "trainer.num_threads=1",
        ],
    )
    local = ray_wg = None
    try:
        local = create_worker_group(
            "local",
            ActorWorker,
            kwargs={"cfg": cfg, "total_steps": 1},
            world_size=1,
            name="actor_dp1",
        )
        ray_wg = create_worker_group(
            "ray",
            ActorWorker,
            kwargs={"cfg": cfg, "total_steps": 1},
            world_size=2,
            name=f"actor_dp2_{request.param}",
            init_dist=True,
        )
        yield local, ray_wg, request.param
    finally:
        for g in (local, ray_wg):
            if g is not None:
                g.shutdown()


def _weights_local(wg) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in wg.get_per_tensor_param()}


def _weights_ray(wg) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in FrameStream.from_actor(wg).tensors():
        out[k] = v.clone()
    return out


def _prepared(
    local, make_batch, rows: int, masked_rows: slice | None, zero_adv: slice | None = None
) -> DataProto:
    batch = make_batch(num_prompts=4, n=4, seed=11)[list(range(rows))]
    if zero_adv is not None:
        adv = batch.batch["advantages"].clone()
        adv[zero_adv] = 0.0
        batch.batch["advantages"] = adv
    batch = batch.union(local.compute_log_prob(batch))
    batch.batch["old_log_probs"] = (
        batch.batch["old_log_probs"] + 0.05 * batch.batch["response_mask"]
    )  # ratios ≠ 1
    if masked_rows is not None:
        rm = batch.batch["response_mask"].clone()
        rm[masked_rows] = 0
        batch.batch["response_mask"] = rm
    return batch


# Run in order on the same two groups: each case starts from the weights the previous one left.
CASES = [
    pytest.param(16, None, id="even-split"),
    pytest.param(
        15, None, id="padded-row-masked"
    ),  # 15 rows → one masked pad row, not a re-trained duplicate
    pytest.param(
        16, slice(8, 16), id="rank1-has-no-valid-row"
    ),  # rank 1 runs placeholders, no deadlock
    pytest.param(16, slice(2, 5), id="some-empty-rows"),
    pytest.param(16, (slice(2, 5), slice(6, 16)), id="zero-advantage-rows"),  # rank 1: none
]


@pytest.mark.parametrize(("rows", "masked"), CASES)
def test_dp2_update_equals_dp1(groups, make_batch, rows, masked):
    local, ray_wg, _ = groups
    zero_adv = None
    if isinstance(masked, tuple):  # (masked rows, rows whose advantages are 0)
        masked, zero_adv = masked
    batch = _prepared(local, make_batch, rows, masked, zero_adv)
    before = _weights_local(local)
    torch.testing.assert_close(_weights_ray(ray_wg), before, atol=1e-6, rtol=1e-5)  # same start

    m1 = local.update_actor(batch).meta_info["metrics"]
    m2 = ray_wg.update_actor(pad_masked_rows(batch, 2)).meta_info[
        "metrics"
    ]  # what Roles.update_actor sends
    w1, w2 = _weights_local(local), _weights_ray(ray_wg)

    assert set(m1) == set(m2)
    for k in m1:
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m1["actor/grad_norm"] > 0
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4, (
        f"the update barely moved the weights ({moved}); the comparison would be vacuous"
    )
    for k in w1:
        torch.testing.assert_close(
            w2[k], w1[k], atol=1e-6, rtol=1e-5, msg=lambda s, k=k: f"{k}: {s}"
        )


def test_unmasked_dispatch_padding_would_train_a_row_twice(groups, make_batch):
    """Why Roles pads with masked rows: the dispatch's own padding repeats a real row."""
    local, _, _ = groups
    batch = _prepared(local, make_batch, 15, None)
    padded, pad = batch.pad_to_divisor(2)
    assert pad == 1 and bool(padded.batch["response_mask"][-1].any())  # a live duplicate of row 0
    ours = pad_masked_rows(batch, 2)
    assert len(ours) == 16 and not bool(ours.batch["response_mask"][-1].any())
    assert not bool(ours.batch["advantages"][-1].any())
    assert torch.equal(ours.batch["input_ids"][:15], batch.batch["input_ids"])


def test_ranks_stayed_in_step(groups):
    """After the cases above: fsdp2 ranks hold half the model each and had to pad passes."""
    _, ray_wg, strategy = groups
    stats = ray_wg.shard_stats()
    full = stats[0]["full"]
    if strategy == "ddp":
        assert all(s["local"] == full and s["dummy_passes"] == 0 for s in stats)
        return
    assert all(abs(s["local"] - full / 2) <= 0.01 * full for s in stats), stats
    # rank 1 gets one placeholder row when its half has no valid row ("rank1-has-no-valid-row"),
    # while rank 0's 8 rows need 2 micro-batches of <= 32 tokens: rank 1 padded with a dummy pass.
    assert stats[1]["dummy_passes"] >= 1 and stats[0]["dummy_passes"] == 0, stats
