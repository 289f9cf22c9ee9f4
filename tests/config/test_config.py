import re

import pytest

from postrl.config import ConfigError, dump_config, load_config, validate_config


def test_yaml_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  n: 4\nactor:\n  optim:\n    lr: 1.0e-5\n")
    cfg = load_config(
        y, ["rollout.n=2", "actor.optim.lr=3e-5", "data.train_files=[a.parquet,b.parquet]"]
    )
    assert cfg.rollout.n == 2 and cfg.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    dump_config(cfg, tmp_path / "out.yaml")
    assert load_config(tmp_path / "out.yaml").rollout.n == 2


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'rollout.temperature'"):
        load_config(None, ["rollout.temprature=0.5"])
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, ["rollout.n=abc"])


def test_validation_reports_all_problems_with_fix(tmp_path):
    cfg = load_config(
        None, ["data.train_batch_size=30", "actor.ppo_mini_batch_size=8", "rollout.top_p=1.5"]
    )
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_registries=False)
    msg = str(e.value)
    assert "model.path is empty" in msg
    assert "data.train_batch_size=30 is not divisible by actor.ppo_mini_batch_size=8" in msg
    assert "rollout.top_p=1.5" in msg


def test_adaptive_entropy_settings_are_checked():
    """``actor.entropy_target`` needs a positive step and a start inside ``[0, max]``."""
    for over, needle in (
        (["actor.entropy_target=-1"], "actor.entropy_target=-1.0 must be >= 0"),
        (["actor.entropy_target=0.4", "actor.entropy_coeff_step=0"], "entropy_coeff_step > 0"),
        (
            ["actor.entropy_target=0.4", "actor.entropy_coeff=0.2", "actor.entropy_coeff_max=0.1"],
            "raise entropy_coeff_max",
        ),
        (
            ["actor.entropy_target=0.4", "actor.entropy_coeff=0.0", "actor.entropy_coeff_min=0.01"],
            "0 <= actor.entropy_coeff_min <= actor.entropy_coeff",
        ),
    ):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            validate_config(load_config(None, ["model.path=m", *over]), check_registries=False)


def test_dp_contract_message():
    cfg = load_config(
        None,
        [
            "trainer.backend=ray",
            "trainer.num_workers=4",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=3",
            "data.train_batch_size=6",
        ],
    )
    with pytest.raises(
        ConfigError,
        match="3 × rollout.n=2 = 6 .* not divisible by trainer.num_workers=4.*multiple of 2",
    ):
        validate_config(cfg, check_files=False, check_registries=False)


def test_every_field_documented_and_docs_current():
    import dataclasses
    from pathlib import Path

    from postrl.config import schema
    from postrl.config.docs import field_docs, render_markdown

    for name, cls in vars(schema).items():
        if dataclasses.is_dataclass(cls) and name != "PostRLConfig":
            docs = field_docs(cls)
            missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
            assert not missing, f"{name} fields without a docstring: {missing}"
    committed = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert committed.read_text().strip() == render_markdown().strip(), (
        "run python -m postrl.config.docs"
    )


def test_fuse_old_log_prob_resolution_and_errors():
    """auto = on exactly when the update is on-policy and nothing reads old log-probs before it."""
    from postrl.config.validate import old_log_prob_fusion_blockers
    from postrl.trainer.roles import resolve_fuse_old_log_prob

    on = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    assert old_log_prob_fusion_blockers(on) == [] and resolve_fuse_old_log_prob(on)
    off = load_config(
        None,
        [
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "algorithm.use_kl_in_reward=true",
        ],
    )
    reasons = old_log_prob_fusion_blockers(off)
    assert len(reasons) == 2 and not resolve_fuse_old_log_prob(off)
    assert not resolve_fuse_old_log_prob(
        load_config(
            None,
            [
                "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=4",
                "actor.fuse_old_log_prob=false",
            ],
        )
    )
    forced = load_config(
        None,
        [
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
            "actor.fuse_old_log_prob=true",
        ],
    )
    with pytest.raises(ConfigError, match=r"actor.fuse_old_log_prob=True but actor.ppo_epochs=2"):
        validate_config(forced, check_files=False, check_registries=False)


def _algo_errors(overrides: list[str]) -> str:
    """The validation message of a config that is otherwise valid (model path and data set)."""
    cfg = load_config(None, ["model.path=m", "data.train_files=[t.parquet]", *overrides])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False)
    return str(e.value)


def test_skip_zero_advantage_needs_a_loss_that_declares_it():
    """``actor.skip_zero_advantage`` with a loss that selects tokens by batch statistics is
    refused at startup, naming the field and the fix; a declaring loss passes."""
    msg = _algo_errors(
        ["actor.skip_zero_advantage=true", "actor.policy_loss=clip_cov", "model.dtype=x"]
    )
    assert "actor.skip_zero_advantage=true with actor.policy_loss='clip_cov'" in msg
    assert "set actor.skip_zero_advantage=false" in msg
    assert "skip_zero_advantage" not in _algo_errors(
        ["actor.skip_zero_advantage=true", "model.dtype=x"]
    )


def test_misspelt_hyperparameters_rejected_at_startup():
    """Estimator and loss hyperparameters are bound against typed signatures, not ignored."""
    msg = _algo_errors(
        [
            "actor.policy_loss=sapo",
            "actor.policy_loss_kwargs={tau_poss: 2.0}",
            "algorithm.adv_estimator_kwargs={epsilonn: 1.0e-4}",
        ]
    )
    assert "actor.policy_loss_kwargs.tau_poss: policy loss 'sapo' has no hyperparameter" in msg
    assert "did you mean 'tau_pos'" in msg
    assert "algorithm.adv_estimator_kwargs.epsilonn" in msg and "did you mean 'epsilon'" in msg
    msg = _algo_errors(["actor.policy_loss_kwargs={clip_ratio_high: 0.28}", "model.dtype=x"])
    assert "set actor.clip_ratio_high instead" in msg
    ok = load_config(
        None,
        [
            "model.path=m",
            "data.train_files=[t.parquet]",
            "actor.policy_loss=sapo",
            "actor.policy_loss_kwargs={tau_pos: 2.0}",
            "algorithm.adv_estimator_kwargs={epsilon: 1.0e-4}",
        ],
    )
    validate_config(ok, check_files=False)


def test_declared_needs_have_producers():
    """remax and optimal_token_baseline validate; a need nothing produces is a startup error."""
    from postrl.algos import register_adv_est

    for est in ("remax", "optimal_token_baseline"):
        cfg = load_config(
            None, ["model.path=m", "data.train_files=[t.parquet]", f"algorithm.adv_estimator={est}"]
        )
        validate_config(cfg, check_files=False)

    @register_adv_est("test_cfg_needs_nothing_makes", needs=("telepathy",))
    def _est(*, token_level_rewards, response_mask, **kw):
        return token_level_rewards, token_level_rewards

    msg = _algo_errors(["algorithm.adv_estimator=test_cfg_needs_nothing_makes"])
    assert "algorithm.adv_estimator='test_cfg_needs_nothing_makes' needs 'telepathy'" in msg
    assert "register_need" in msg
    msg = _algo_errors(["algorithm.adv_estimator=gae", "critic.optim.lr=0"])
    assert "algorithm.adv_estimator='gae' needs 'values'" in msg and "critic.optim.lr > 0" in msg


def test_otb_blocks_old_log_prob_fusion():
    """OTB reads old log-probs and sum_pi_squared before the update: auto fusion turns off."""
    from postrl.config.validate import old_log_prob_fusion_blockers
    from postrl.trainer.roles import resolve_fuse_old_log_prob

    base = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    otb = load_config(None, [*base, "algorithm.adv_estimator=optimal_token_baseline"])
    (why,) = old_log_prob_fusion_blockers(otb)
    assert "sum_pi_squared before the update" in why and not resolve_fuse_old_log_prob(otb)
    assert resolve_fuse_old_log_prob(load_config(None, [*base, "algorithm.adv_estimator=remax"]))
    msg = _algo_errors(
        [*base, "algorithm.adv_estimator=optimal_token_baseline", "actor.fuse_old_log_prob=true"]
    )
    assert (
        "actor.fuse_old_log_prob=True but algorithm.adv_estimator='optimal_token_baseline'" in msg
    )


def test_engine_settings_take_their_defaults_from_the_engine_specs():
    """No default written twice: a config field the engine also takes names the spec's default
    (``lr: float = OptimSpec.lr``) instead of repeating the literal."""
    import ast
    import dataclasses
    import inspect

    from postrl.config import schema
    from postrl.config.distill import DistillConfig
    from postrl.config.supervised import SFTConfig
    from postrl.engine import specs

    pairs = [
        (schema.ModelConfig, specs.ModelSpec, {}),
        (schema.OptimConfig, specs.OptimSpec, {}),
        (schema.ActorConfig, specs.BatchSpec, {}),
        (schema.ActorConfig, specs.PolicyLossSpec, {}),
        (schema.CriticConfig, specs.BatchSpec, {}),
        (DistillConfig, specs.PolicyLossSpec, {"coef": "distill_coef", "beta": "distill_beta"}),
        (SFTConfig, specs.OptimSpec, {}),  # lr, warmup_steps: TrainFileOptions' own choices
        (SFTConfig, specs.ModelSpec, {}),
    ]
    checked = 0
    for cfg_cls, spec_cls, rename in pairs:
        spec_fields = {
            f.name: f for f in dataclasses.fields(spec_cls) if f.default is not dataclasses.MISSING
        }
        for node in ast.parse(inspect.getsource(cfg_cls)).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = rename.get(node.target.id, node.target.id)
            if name not in spec_fields:
                continue
            src = ast.unparse(node.value)
            assert f"{spec_cls.__name__}.{name}" in src, (
                f"{cfg_cls.__name__}.{node.target.id} = {src}: take the default from "
                f"{spec_cls.__name__}.{name} (postrl/engine/specs.py owns it)"
            )
            value = getattr(cfg_cls(), node.target.id)
            value = tuple(value) if isinstance(value, list) else value  # betas: YAML list
            assert value == spec_fields[name].default
            checked += 1
    assert checked >= 30
