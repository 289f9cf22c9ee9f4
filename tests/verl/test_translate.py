"""The verl -> postrl translation: Hydra parsing, verl's defaults and interpolations, no-ops
logged once with a reason, rejections with the nearest setting, did-you-mean, print-config."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from postrl.config import load_config
from postrl.verl import RULES, VerlConfigError, translate
from postrl.verl.hydra import parse_override, parse_value
from postrl.verl.main_ppo import main as verl_main
from postrl.verl.main_ppo import minimal_yaml
from postrl.verl.translate import lookup_rule

A = "actor_rollout_ref.actor"
RO = "actor_rollout_ref.rollout"
MICRO = [f"{A}.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


@pytest.mark.parametrize(
    "raw, value",
    [
        ("1e-6", 1e-6),  # Hydra float (YAML 1.1 would keep the string)
        ("5", 5),
        ("True", True),
        ("false", False),
        ("null", None),
        ("'error'", "error"),  # quotes the shell did not remove
        ('["console","wandb"]', ["console", "wandb"]),
        ("[console,wandb]", ["console", "wandb"]),
        ("['/a/x.parquet', '/b/y.parquet']", ["/a/x.parquet", "/b/y.parquet"]),
        ("[1e-3, 2]", [1e-3, 2]),
        ("$HOME/x", "$HOME/x"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_hydra_values(raw, value):
    assert parse_value(raw) == value


def test_hydra_prefixes():
    assert parse_override("+a.b=1").op == "add"
    assert parse_override("++a.b=1").op == "force"
    assert parse_override("~a.b").op == "delete"
    with pytest.raises(ValueError, match="key=value"):
        parse_override("data.train_files")


def test_verl_defaults_apply_where_postrl_differs():
    cfg = translate(MICRO).config
    # verl's defaults, not postrl's (postrl: grpo, n=8, wd 0, dynamic bsz on, 20 steps)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.rollout.n == 1
    assert cfg.actor.optim.weight_decay == 0.01 and cfg.actor.optim.lr == 1e-6
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor.use_dynamic_bsz is False
    assert cfg.trainer.total_steps == 0 and cfg.trainer.total_epochs == 30
    assert cfg.data.train_batch_size == 1024 and cfg.rollout.response_length == 512
    assert cfg.trainer.run_dir == "checkpoints/verl_examples/gsm8k"
    assert cfg.model.gradient_checkpointing is True  # enable_gradient_checkpointing: True
    assert cfg.data.val_batch_size == 0 and cfg.trainer.save_freq == 0


def test_interpolations_follow_and_explicit_values_win():
    cfg = translate(
        [
            *MICRO,
            f"{A}.ppo_mini_batch_size=8",
            f"{A}.use_dynamic_bsz=True",
            "data.max_response_length=64",
            f"{A}.ppo_epochs=2",
        ]
    ).config
    # critic.* defaults are ${actor_rollout_ref.actor.*}; rollout.response_length is
    # ${data.max_response_length}
    assert cfg.critic.ppo_mini_batch_size == 8 and cfg.critic.use_dynamic_bsz is True
    assert cfg.critic.ppo_epochs == 2 and cfg.rollout.response_length == 64
    cfg = translate([*MICRO, "critic.ppo_mini_batch_size=4", f"{RO}.response_length=32"]).config
    assert cfg.critic.ppo_mini_batch_size == 4 and cfg.rollout.response_length == 32
    cfg = translate([*MICRO, "data.max_prompt_length=77", f"{A}.clip_ratio=0.3"]).config
    assert cfg.data.max_prompt_length == 77
    assert cfg.actor.clip_ratio_low == cfg.actor.clip_ratio_high == 0.3  # legacy clip_ratio
    cfg = translate(
        [*MICRO, "critic.ppo_micro_batch_size_per_gpu=${" + A + ".ppo_mini_batch_size}"]
    )
    assert cfg.config.critic.ppo_micro_batch_size_per_gpu == 256  # a user interpolation


def test_noops_log_one_line_each_with_the_reason(caplog):
    args = [
        *MICRO,
        f"{A}.fsdp_config.param_offload=True",
        f"{RO}.tensor_model_parallel_size=1",
        f"{RO}.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    ]
    with caplog.at_level(logging.INFO, logger="postrl.verl"):
        t = translate(args)
    lines = [r.getMessage() for r in caplog.records]
    for key in (
        "param_offload",
        "tensor_model_parallel_size",
        "gpu_memory_utilization",
        "ref.log_prob_micro_batch_size_per_gpu",
    ):
        hits = [ln for ln in lines if key in ln and "has no effect here" in ln]
        assert len(hits) == 1, (key, lines)
    assert any("offload" in n and "FSDP2 shards" in n for n in t.notes)


def test_rejections_and_unknown_keys_reported_together():
    with pytest.raises(VerlConfigError) as e:
        translate(
            [
                *MICRO,
                f"{A}.megatron.tensor_model_parallel_size=2",
                "data.truncation=left",
                f"{A}.ulysses_sequence_parallel_size=2",
                f"{A}.ppo_micro_batch_sze_per_gpu=2",
                "trainer.loger=console",
                "algoritm.gamma=0.9",
                "trainer.critic_warmup=3",
            ]
        )
    msg = str(e.value)
    assert msg.startswith("7 verl key(s)")
    assert "no Megatron engine; nearest supported: actor_rollout_ref.actor.strategy=fsdp" in msg
    assert "nearest supported: data.filter_overlong_prompts=True" in msg
    assert "no sequence parallelism" in msg
    assert f"did you mean '{A}.ppo_micro_batch_size_per_gpu'?" in msg
    assert "did you mean 'trainer.logger'?" in msg and "did you mean 'algorithm.gamma'?" in msg
    assert "trainer.critic_warmup=3 is not supported" in msg


def test_defaults_of_rejected_keys_are_accepted():
    t = translate(
        [
            *MICRO,
            "trainer.critic_warmup=0",
            f"{A}.ulysses_sequence_parallel_size=1",
            "actor_rollout_ref.model.mtp.enable=False",
            "distillation.enabled=False",
        ]
    )
    assert len(t.notes) >= 4


def test_micro_batch_size_required_like_verl():
    with pytest.raises(VerlConfigError, match=f"{A}.ppo_micro_batch_size_per_gpu=None"):
        translate([])
    # GRPO builds no critic, so the critic's size is not needed; dynamic batching needs neither
    translate(["algorithm.adv_estimator=grpo", f"{A}.ppo_micro_batch_size_per_gpu=2"])
    cfg = translate([f"{A}.use_dynamic_bsz=True"]).config
    assert cfg.actor.use_dynamic_bsz and cfg.critic.use_dynamic_bsz
    # verl's deprecated global size is divided over the devices
    cfg = translate(
        [
            "algorithm.adv_estimator=grpo",
            f"{A}.ppo_micro_batch_size=16",
            "trainer.n_gpus_per_node=4",
        ]
    ).config
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_without_vllm_names_the_extra_and_the_cpu_alternative(monkeypatch):
    import sys

    import postrl.rollout.base as base

    monkeypatch.setattr(base, "replica_python", lambda name, configured="": sys.executable)
    with pytest.raises(VerlConfigError) as e:  # no vLLM here and no vLLM venv
        translate([*MICRO, f"{RO}.name=vllm"])
    assert "pip install 'postrl[vllm]'" in str(e.value) and "make vllm-venv" in str(e.value)
    assert f"{RO}.name=native" in str(e.value)


def test_vllm_with_the_vllm_venv_is_the_vllm_backend(monkeypatch):
    import postrl.rollout.base as base

    monkeypatch.setattr(base, "replica_python", lambda name, configured="": "/venv/bin/python")
    assert translate([*MICRO, f"{RO}.name=vllm"]).config.rollout.backend == "vllm"


def test_vllm_engine_options_pass_through_when_installed(monkeypatch):
    import postrl.verl.convert as conv

    real = importlib.util.find_spec
    monkeypatch.setattr(
        conv.importlib.util, "find_spec", lambda n: object() if n == "vllm" else real(n)
    )
    cfg = translate(
        [
            *MICRO,
            f"{RO}.name=vllm",
            f"{RO}.tensor_model_parallel_size=2",
            f"{RO}.gpu_memory_utilization=0.6",
            f"+{RO}.engine_kwargs.vllm.swap_space=4",
        ]
    ).config
    assert cfg.rollout.backend == "vllm"
    kw = cfg.rollout.engine_kwargs
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.6
    assert kw["swap_space"] == 4 and kw["enable_prefix_caching"] is True  # verl's default
    # verl's GPU defaults for what the adapter picks per platform (eager, chunked prefill,
    # tensor parallel) give way to it; values the user sets pass
    assert not {"enforce_eager", "enable_chunked_prefill"} & set(kw)
    base = [*MICRO, f"{RO}.name=vllm"]
    assert "tensor_parallel_size" not in translate(base).config.rollout.engine_kwargs
    kw = translate([*base, f"{RO}.enforce_eager=False"]).config.rollout.engine_kwargs
    assert kw["enforce_eager"] is False


def test_loggers_modes_resume_and_rewards():
    t = translate(
        [
            *MICRO,
            "trainer.logger=['console','tensorboard','file']",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.resume_mode=resume_path",
            "trainer.resume_from_path=/ckpt/step_10",
            "custom_reward_function.path=r.py",
            "+custom_reward_function.reward_kwargs.format_score=0.1",
            "reward_model.reward_manager=batch",
            "postrl.rollout.num_replicas=2",
        ]
    )
    c = t.config
    assert c.trainer.loggers == ["console", "tensorboard", "jsonl"]
    assert c.trainer.mode == "fully_async" and c.trainer.resume_mode == "/ckpt/step_10"
    assert c.reward.custom_function.path.endswith("r.py") and c.reward.custom_function.batch
    assert c.reward.reward_kwargs == {"format_score": 0.1}
    assert c.rollout.num_replicas == 2  # postrl.* keys pass straight through
    with pytest.raises(VerlConfigError, match="no 'mlflow' metric sink"):
        translate([*MICRO, "trainer.logger=['console','mlflow']"])


def test_policy_loss_kwargs_reach_only_losses_that_take_them(caplog):
    cfg = translate([*MICRO, f"{A}.policy_loss.loss_mode=clip_cov"]).config
    assert cfg.actor.policy_loss == "clip_cov"
    assert cfg.actor.policy_loss_kwargs["clip_cov_ratio"] == 0.0002  # verl's default
    with caplog.at_level(logging.INFO, logger="postrl.verl"):
        cfg = translate([*MICRO, f"{A}.policy_loss.kl_cov_ratio=0.01"]).config
    assert cfg.actor.policy_loss_kwargs == {} and "no 'kl_cov_ratio'" in caplog.text


def test_print_config_round_trips(tmp_path, capsys):
    args = [
        *MICRO,
        "algorithm.adv_estimator=grpo",
        f"{RO}.n=4",
        f"{A}.fsdp_config.param_offload=True",
    ]
    t = translate(args)
    text = minimal_yaml(t)
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml") == t.config  # exactly the translated config
    assert text.startswith("# postrl config translated") and "# verl actor_rollout_ref" in text
    assert verl_main(["--print-config", *args]) == 0
    assert capsys.readouterr().out == text


def test_verl_yaml_config_file(tmp_path):
    (tmp_path / "my_ppo.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nalgorithm:\n  adv_estimator: grpo\n"
        "actor_rollout_ref:\n  rollout:\n    n: 6\n  actor:\n    ppo_micro_batch_size_per_gpu: 2\n"
    )
    from postrl.verl.main_ppo import _load_base

    base = _load_base(str(tmp_path), "my_ppo")
    cfg = translate([f"{RO}.n=3"], base=base).config
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 3  # the command line wins


def test_every_rule_accepts_verls_default():
    """Every key of the table, set explicitly to verl's documented default, is accepted."""
    for rule in RULES:
        if rule.is_tree or not isinstance(rule.default, (int, float, str, list, type(None))):
            continue
        if rule.key in (f"{RO}.name",) or lookup_rule(rule.key) is not rule:
            continue
        node: dict = {}
        parts = rule.key.split(".")
        d = node
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = rule.default
        try:
            translate(MICRO, base=node)
        except VerlConfigError as e:  # pragma: no cover - the message names the key
            raise AssertionError(f"{rule.key}={rule.default!r}: {e}") from e


def test_a_refused_row_is_an_error_not_a_traceback(verl_home, tiny_model_dir, tmp_path, caplog):
    args = [
        f"data.train_files={verl_home}/data/gsm8k/train.parquet",
        "data.val_files=[]",
        "data.max_prompt_length=8",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "algorithm.adv_estimator=grpo",
        f"{A}.ppo_micro_batch_size_per_gpu=2",
        f"trainer.default_local_dir={tmp_path}",
    ]
    assert verl_main(args) == 2
    assert "data.max_prompt_length=8" in caplog.text
    assert "raise data.max_prompt_length or set data.truncation=filter" in caplog.text
    assert (tmp_path / "verl_translated.yaml").exists() and (tmp_path / "verl_args.txt").exists()


def test_estimator_and_loss_names_checked_against_postrls_registries():
    cfg = translate([*MICRO, "algorithm.adv_estimator=grpo_vectorized"]).config
    assert cfg.algorithm.adv_estimator == "grpo"
    with pytest.raises(VerlConfigError, match="no 'dppo_tv' policy loss; nearest supported: "):
        translate([*MICRO, f"{A}.policy_loss.loss_mode=dppo_tv"])
    with pytest.raises(VerlConfigError, match="no 'tir_optimal_token_baseline' estimator"):
        translate([*MICRO, "algorithm.adv_estimator=tir_optimal_token_baseline"])


def test_colocate_async_maps_to_one_step_off_with_its_staleness_keys():
    t = translate(
        [
            *MICRO,
            "trainer.v1.trainer_mode=colocate_async",
            "trainer.v1.colocate_async.num_warmup_batches=2",
            "trainer.v1.sampler.max_off_policy_threshold=3",
            "trainer.v1.sampler.max_off_policy_strategy=drop",
        ]
    )
    a = t.config.trainer.async_
    assert t.config.trainer.mode == "one_step_off"
    assert (a.num_warmup_batches, a.max_staleness, a.staleness_strategy) == (1, 3, "drop")
    assert load_config(None, []).trainer.async_.max_staleness == 1  # YAML round trip below
    assert "async:" in minimal_yaml(t) and "async_" not in minimal_yaml(t)
    # sync ignores the sampler's off-policy threshold (it trains on-policy)
    sync = translate([*MICRO, "trainer.v1.sampler.max_off_policy_threshold=3"]).config.trainer
    assert sync.mode == "sync" and sync.async_.max_staleness == 1
    with pytest.raises(VerlConfigError) as e:
        translate(
            [
                *MICRO,
                "trainer.v1.trainer_mode=colocate_async",
                "trainer.v1.colocate_async.num_warmup_batches=4",
                "trainer.v1.sampler.max_off_policy_threshold=2",
            ]
        )
    assert "trainer.v1.sampler.max_off_policy_threshold=4" in str(e.value)


SEPARATE = [
    *MICRO,
    "trainer.v1.trainer_mode=separate_async",
    "data.train_batch_size=64",
    f"{A}.ppo_mini_batch_size=16",
]


def test_separate_async_maps_to_fully_async_with_its_parameter_sync_step(caplog):
    from postrl.config.validate import async_errors

    with caplog.at_level(logging.INFO, logger="postrl.verl"):
        t = translate(
            [
                *SEPARATE,
                "trainer.v1.separate_async.parameter_sync_step=4",
                "trainer.v1.separate_async.num_warmup_batches=2",
                "trainer.v1.sampler.max_off_policy_threshold=2",
            ]
        )
    a = t.config.trainer.async_
    assert t.config.trainer.mode == "fully_async"
    assert (a.parameter_sync_step, a.max_staleness, a.num_warmup_batches) == (4, 2, 0)
    assert async_errors(t.config) == []  # postrl's own fully_async contract holds
    assert "parameter_sync_step: 4" in minimal_yaml(t)
    assert "num_warmup_batches: 2 has no effect here" in caplog.text
    # verl's defaults (1024 = 4 × 256) satisfy the contract without setting the key
    default = translate([*MICRO, "trainer.v1.trainer_mode=separate_async"]).config
    assert default.trainer.async_.parameter_sync_step == 4


def test_separate_async_batch_sizes_must_match_parameter_sync_step():
    with pytest.raises(VerlConfigError) as e:
        translate([*SEPARATE, "trainer.v1.separate_async.parameter_sync_step=3"])
    msg = str(e.value)
    assert "parameter_sync_step=3" in msg and "data.train_batch_size=64" in msg
    assert (
        "nearest supported: data.train_batch_size=48 or "
        "trainer.v1.separate_async.parameter_sync_step=4" in msg
    )
    with pytest.raises(VerlConfigError, match=r"data\.train_batch_size=64 must equal"):
        translate([*SEPARATE, f"{A}.ppo_mini_batch_size=32"])  # verl's default step 4


def test_separate_async_hybrid_rollout_maps_to_the_idle_switch():
    on = translate([*SEPARATE, "trainer.v1.separate_async.hybrid_rollout.enable=True"])
    assert on.config.trainer.async_.idle_switch == "auto"
    off = translate(
        [
            *SEPARATE,
            "trainer.v1.separate_async.hybrid_rollout.enable=False",
            "+trainer.v1.separate_async.hybrid_rollout.idle_threshold=0.5",
        ]
    )
    assert off.config.trainer.mode == "fully_async"
    assert off.config.trainer.async_.idle_switch == "never"


def test_sync_and_colocate_async_ignore_the_separate_async_keys():
    keys = [
        "trainer.v1.separate_async.parameter_sync_step=3",  # 3 × 256 != 1024: unread here
        "trainer.v1.separate_async.num_warmup_batches=5",
        "trainer.v1.separate_async.hybrid_rollout.enable=True",
    ]
    sync = translate([*MICRO, *keys]).config.trainer
    assert sync.mode == "sync" and sync.async_.parameter_sync_step == 1
    assert sync.async_.idle_switch == "never"
    colocate = translate([*MICRO, "trainer.v1.trainer_mode=colocate_async", *keys]).config
    assert colocate.trainer.mode == "one_step_off"
    assert colocate.trainer.async_.parameter_sync_step == 1
    assert colocate.trainer.async_.num_warmup_batches == 0  # colocate_async's own key (1)
