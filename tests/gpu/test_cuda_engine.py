"""FSDP2 on CUDA: a single-process bf16 mixed-precision update points where the CPU fp32 update
points, and stays finite."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import free_port, synth_batch

from postrl.config import load_config
from postrl.engine.actor import Actor
from postrl.engine.checkpoint import iter_hf_params
from postrl.engine.model import load_policy
from postrl.workers.common import batch_spec, model_spec, optim_spec, policy_loss_spec

pytestmark = pytest.mark.gpu


def _actor(cfg, device: str, group=None) -> Actor:
    policy = load_policy(model_spec(cfg.model), device)
    if group is not None:
        policy.shard(group, device)  # FSDP2 units; MixedPrecisionPolicy from compute_dtype
    return Actor(
        policy,
        batch=batch_spec(cfg.actor),
        loss=policy_loss_spec(cfg.actor),
        optim=optim_spec(cfg.actor.optim),
        rollout_n=cfg.rollout.n,
        share_prefix=True,
        device=device,
        group=group,
        total_steps=1,
    )


def _params(actor: Actor) -> dict[str, torch.Tensor]:
    """Full fp32 CPU copies of every parameter (FSDP2 shards gathered one at a time)."""
    return {k: v.detach().float().cpu().clone() for k, v in iter_hf_params(actor.policy)}


def test_fsdp2_bf16_update_matches_cpu_fp32_direction(device, tiny_model_factory):
    """One PPO update of the same batch: FSDP2 (one rank, bf16 gathers and math, fp32 shards,
    gradients and AdamW state) on ``device`` vs the unsharded fp32 model on CPU.

    AdamW with ``eps`` ≫ |g| is SGD with step ``lr/eps · g``, so each update is the gradient
    itself and the directions compare tightly (cosine > 0.99); bf16 log-probs differ from fp32
    ones by rounding only (0 < |Δ| < 0.1)."""
    d = tiny_model_factory("qwen2")
    ov = [
        f"model.path={d}",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.optim.lr=1000.0",
        "actor.optim.eps=1000.0",
        "actor.optim.grad_clip=1e6",
        "actor.entropy_coeff=0.01",
    ]
    ref = _actor(load_config(None, [*ov, "model.compute_dtype=float32"]), "cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        mixed = _actor(
            load_config(None, [*ov, "model.compute_dtype=bfloat16"]), device, dist.group.WORLD
        )
        before = _params(ref)
        assert all(torch.equal(before[k], v) for k, v in _params(mixed).items())
        batch = synth_batch(num_prompts=4, n=4, seed=11)
        lp_ref = ref.compute_log_prob(batch).batch["old_log_probs"]
        lp_mix = mixed.compute_log_prob(batch).batch["old_log_probs"]
        mask = batch.batch["response_mask"].bool()
        err = float((lp_mix - lp_ref)[mask].abs().max())
        assert 0 < err < 0.1, f"bf16 log-probs vs fp32: max |diff| {err}"
        batch = batch.union(ref.compute_log_prob(batch))  # the same old log-probs for both
        m_ref = ref.update_policy(batch).metrics
        m_mix = mixed.update_policy(batch).metrics
        g_ref, g_mix = m_ref["actor/grad_norm"], m_mix["actor/grad_norm"]
        assert abs(g_mix / g_ref - 1) < 0.1, f"grad norm bf16 {g_mix} vs fp32 {g_ref}"
        assert all(math.isfinite(v) for v in m_mix.values()), m_mix
        assert m_mix["actor/grad_norm"] > 0
        after_ref, after_mix = _params(ref), _params(mixed)
        assert all(torch.isfinite(v).all() for v in after_mix.values())
        assert all(p.dtype == torch.float32 for p in mixed.policy.module.parameters())
        d_ref = torch.cat([(after_ref[k] - before[k]).flatten() for k in sorted(before)])
        d_mix = torch.cat([(after_mix[k] - before[k]).flatten() for k in sorted(before)])
        assert float(d_ref.norm()) > 0
        cos = float(torch.nn.functional.cosine_similarity(d_ref.double(), d_mix.double(), dim=0))
        print(f"fsdp2 bf16 on {device} vs fp32 cpu: cosine {cos:.5f}, max|dlp| {err:.2e}")
        assert cos > 0.99, f"bf16 FSDP2 update on {device} vs fp32 CPU: cosine {cos:.4f}"
        ratio = float(d_mix.norm() / d_ref.norm())
        assert 0.9 < ratio < 1.1, f"update size ratio {ratio:.3f}"
    finally:
        dist.destroy_process_group()
