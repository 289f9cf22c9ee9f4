"""Decoupled PPO end to end (sync mode, tiny model) and its startup validation; the batch's
per-token policy versions in the default sync run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from postrl.config import ConfigError, load_config, validate_config
from postrl.trainer import needs as N
from postrl.trainer.trainer import RLTrainer


def _errors(base: list[str], *overrides: str) -> str:
    cfg = load_config(None, [*base, "actor.policy_loss=decoupled", *overrides])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False)
    return str(e.value)


def test_decoupled_declares_its_needs_and_may_fuse_even_off_policy(small_overrides):
    """π_prox is the update's starting weights: a fused single-mini-batch update's own forward
    is exactly that, in sync and in an off-policy mode (μ comes from the rollout)."""
    cfg = load_config(None, [*small_overrides, "actor.policy_loss=decoupled"])
    assert N.required_needs(cfg) == ["rollout_log_prob", "proximal_log_prob"]
    assert N.fusion_blockers(cfg) == [] and N.reads_proximal(cfg)
    validate_config(cfg, check_files=False)  # the defaults are fine
    off = ["trainer.mode=one_step_off", "actor.ppo_mini_batch_size=4"]  # = train_batch_size
    validate_config(
        load_config(
            None,
            [*small_overrides, *off, "actor.policy_loss=decoupled", "actor.fuse_old_log_prob=true"],
        ),
        check_files=False,
    )
    msg = _errors(
        small_overrides,
        "trainer.mode=one_step_off",
        "actor.policy_loss=vanilla",
        "actor.fuse_old_log_prob=true",
    )
    assert "is off-policy" in msg  # vanilla PPO's old log-probs are the behaviour policy


def test_decoupled_startup_errors_name_the_field_and_the_fix(small_overrides):
    msg = _errors(small_overrides, "algorithm.rollout_correction.bypass_mode=true")
    assert "actor.policy_loss='decoupled' needs 'proximal_log_prob'" in msg
    assert "set algorithm.rollout_correction.bypass_mode=false" in msg
    msg = _errors(small_overrides, "algorithm.rollout_correction.rollout_is=token")
    assert "a second time: unset it and set actor.policy_loss_kwargs.rollout_is" in msg
    msg = _errors(small_overrides, "actor.policy_loss_kwargs={rollout_is_treshold: 3.0}")
    assert "did you mean 'rollout_is_threshold'" in msg


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(overrides: list[str], tmp: Path, loss: str) -> tuple[list[dict], list[tuple]]:
    """Train; return the per-step metric rows and, per rollout batch, (versions, fleet version,
    min_version, max_version, response_mask)."""
    cfg = load_config(
        None,
        [*overrides, f"actor.policy_loss={loss}", f"trainer.run_dir={tmp / loss}"],
    )
    trainer = RLTrainer(cfg)
    seen: list[tuple] = []
    assemble = trainer.ctx.agents.assemble

    def spy(outputs, rows):
        b = assemble(outputs, rows)
        nt = b.non_tensor_batch
        seen.append(
            (
                b.batch["rollout_policy_version"].clone(),
                int(trainer.ctx.fleet.version),
                nt["min_version"].copy(),
                nt["max_version"].copy(),
                b.batch["response_mask"].clone(),
            )
        )
        return b

    trainer.ctx.agents.assemble = spy
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [r for r in _rows(Path(cfg.trainer.run_dir)) if "actor/pg_loss" in r], seen


def test_decoupled_sync_run_matches_vanilla(small_overrides, digits_reward, tmp_path):
    """Sync mode: mu (native engine) ~= pi_prox (training forward), so every weight is ~1 and
    the decoupled loss equals vanilla's to float tolerance; the run trains, metrics finite."""
    ov = [
        *small_overrides,
        f"reward.custom_function.path={digits_reward}",
        "trainer.test_freq=0",
    ]
    van, seen = _run(ov, tmp_path, "vanilla")
    dec, _ = _run(ov, tmp_path, "decoupled")
    assert len(van) == len(dec) == 2
    for v, d in zip(van, dec, strict=True):
        assert all(math.isfinite(x) for x in d.values() if isinstance(x, float))
        assert d["actor/decoupled_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert d["actor/decoupled_is_clipfrac"] == 0.0
        assert abs(d["actor/decoupled_kl_behav"]) < 1e-3
        # measured on AVX2: |diff| ~1e-7 on losses ~1e-3..3e-2 (weights 1 within 1e-7)
        assert d["actor/pg_loss"] == pytest.approx(v["actor/pg_loss"], rel=1e-3, abs=1e-6)
        assert d["actor/grad_norm"] == pytest.approx(v["actor/grad_norm"], rel=1e-4)
        assert d["actor/grad_norm"] > 0  # it trains
    # every rollout batch of the sync run: one constant version = the fleet's at generation
    # (validation rollouts included: they are assembled the same way)
    # the fleet's version moves with every weight sync (the first at startup), so the batches
    # of the two steps carry two different versions
    assert len({fleet_v for _, fleet_v, *_ in seen}) >= 2
    for ver, fleet_v, vmin, vmax, mask in seen:
        real = mask.bool()
        assert real.any() and (ver[real] == fleet_v).all()
        assert (ver[~real] == -1).all()  # padding (no observations in single-turn)
        assert (vmin == fleet_v).all() and (vmax == fleet_v).all()
    assert isinstance(seen[0][0], torch.Tensor) and seen[0][0].dtype == torch.int64
