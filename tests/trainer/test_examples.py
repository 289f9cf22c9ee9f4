"""Every ``examples/*.yaml`` recipe runs end to end, shrunk onto the tiny model and tiny data.

Each recipe is loaded as a user would (``load_config(path, overrides)``), pointed at the fixtures,
shrunk to one or two seconds-long steps, trained with ``RLTrainer.fit()``, and checked for finite
metrics plus the keys its algorithm must produce (the critic's for PPO-GAE, ``dynamic_sampling/*``
for DAPO, the KL terms when a KL is configured). Addition recipes use the dense digits reward so
advantages are non-zero; the countdown recipe keeps its real rule reward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import fit_with_snapshots

from postrl.config import load_config
from postrl.data import generate_countdown, write_parquet
from postrl.trainer.trainer import RLTrainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))

COMMON_KEYS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "critic/score/mean",
    "critic/advantages/mean",
    "timing_s/step",
    "reward/scored",
}
# keys each algorithm must add on top of COMMON_KEYS
EXPECTED_KEYS: dict[str, set[str]] = {
    "grpo_addition": set(),
    "drgrpo_addition": set(),
    "dapo_addition": {
        "dynamic_sampling/num_groups",
        "dynamic_sampling/num_kept_groups",
        "dynamic_sampling/num_dropped_groups",
        "reward/overlong_penalty/mean",
    },
    "grpo_addition_3digit": {
        "dynamic_sampling/num_groups",
        "dynamic_sampling/num_kept_groups",
        "perf/train_time_s",
    },
    "rloo_addition": {"actor/kl_loss"},
    "reinforce_pp_addition": {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"},
    "gspo_addition": set(),
    "grpo_tool_arith": {"agent/num_tool_calls", "agent/token_drift_ratio"},
    "ppo_gae_addition": {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/values/mean",
        "critic/returns/mean",
        "timing_s/values",
        "timing_s/update_critic",
        "actor/reward_kl_penalty",
    },
    "grpo_countdown": {"actor/kl_loss", "reward/extra/acc/mean"},
    "remax_addition": {
        "remax/baseline_score/mean",
        "remax/baseline_failed",
        "remax/baseline_response_length/mean",
    },
    "otb_addition": set(),
    "one_step_off_addition": {
        "replay/staleness/mean",
        "async/interrupted_trajectories",
        "actor/pg_clipfrac",
        "rollout_corr/ess",
        "health/ess_ratio",
        "health/alerts/ess",
    },
    "fully_async_addition": {
        "replay/staleness/mean",
        "async/trainer_idle_fraction",
        "rollout/live_replicas",
        "actor/decoupled_is_mean",
    },
    "opd_addition_3digit": {
        "distill/reverse_kl",
        "distill/teacher_logprob",
        "timing_s/teacher",
        "perf/train_time_s",
    },
    "ppo_rm_addition": {
        "critic/vf_loss",
        "critic/values/mean",
        "timing_s/update_critic",
        "actor/reward_kl_penalty",
        "reward_model/score/mean",
        "reward_model/truncated",
        "timing_s/reward_model",
    },
}


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """A tiny random reward model (stands in for `postrl rm`'s output)."""
    from postrl.testing import make_model

    return make_model(tmp_path_factory.mktemp("rm") / "rm", head="reward", seed=7)


@pytest.fixture(scope="session")
def countdown_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("countdown")
    train = write_parquet(generate_countdown(16, seed=0), d / "train.parquet")
    test = write_parquet(generate_countdown(4, seed=0, split="test"), d / "test.parquet")
    return str(train), str(test)


def _shrunk(
    name: str, tiny_model_dir, addition_files, countdown_files, digits_reward, run_dir: Path
) -> list[str]:
    """Overrides turning a full recipe into a ~5 s run (1 step, 4 prompts × 4 responses, 8
    tokens)."""
    countdown = "countdown" in name
    train, test = countdown_files if countdown else addition_files
    ov = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=4",
        f"data.max_prompt_length={192 if countdown else 48}",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "critic.ppo_mini_batch_size=2",
        "rollout.n=4",
        "rollout.response_length=8",
        "trainer.total_steps=1",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        "trainer.save_freq=0",
    ]
    if name.startswith("opd"):  # the tiny model as its own teacher (same tokenizer): the
        # reverse KL is 0, so the task reward is weighed in for the update to move the policy
        ov += [f"distill.teacher_path={tiny_model_dir}", "distill.task_reward_weight=1"]
    if "fully_async" in name:  # one step = one mini-batch: make it the 4 prompts
        ov += ["actor.ppo_mini_batch_size=4", "trainer.async.parameter_sync_step=1"]
    if countdown:  # the real rule reward and a tiny validation pass
        ov += [
            f"data.val_files=[{test}]",
            "data.max_val_samples=2",
            "trainer.val_before_train=false",
        ]
    else:
        # the stand-in reward takes no recipe-specific kwargs (e.g. tool-arith's partial_credit)
        ov += [
            "data.val_files=[]",
            f"reward.custom_function.path={digits_reward}",
            "reward.reward_kwargs={}",
        ]
    return ov


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_example_runs(
    path: Path,
    tiny_model_dir,
    addition_files,
    countdown_files,
    digits_reward,
    reward_model_dir,
    tmp_path,
):
    run_dir = tmp_path / "run"
    overrides = _shrunk(
        path.stem, tiny_model_dir, addition_files, countdown_files, digits_reward, run_dir
    )
    if "_rm_" in path.stem:  # the learned reward model (and the critic initialised from it)
        overrides += [
            f"reward.model.path={reward_model_dir}",
            f"critic.model_path={reward_model_dir}",
        ]
    cfg = load_config(path, overrides)
    trainer = RLTrainer(cfg)
    try:
        before, last, after = fit_with_snapshots(trainer)
    finally:
        trainer.close()
    want = COMMON_KEYS | EXPECTED_KEYS.get(path.stem, set())
    assert want <= set(last), f"{path.name}: missing {sorted(want - set(last))}"
    bad = {k: v for k, v in last.items() if not math.isfinite(v)}
    assert not bad, f"{path.name}: non-finite metrics {bad}"
    if "fully_async" in path.stem:  # groups beyond the step's are scored as they complete
        assert last["reward/scored"] >= 16
    else:
        assert last["reward/scored"] == 16
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1
    if "countdown" in path.stem:
        assert "val/countdown/acc" in last
        return
    if "critic/vf_loss" in want:  # the critic really trained
        assert last["critic/grad_norm"] > 0 and last["critic/vf_loss"] > 0
    # dense reward → non-zero advantages → the update moved the policy
    assert any(not torch.equal(before[k], after[k]) for k in before), (
        f"{path.name}: no parameter changed"
    )


def test_every_example_is_covered_and_documented():
    """New recipes must declare their expected metrics here and say how to launch them."""
    assert {p.stem for p in EXAMPLE_FILES} == set(EXPECTED_KEYS)
    for p in EXAMPLE_FILES:
        head = p.read_text().split("\nmodel:", 1)[0]
        assert f"postrl train examples/{p.name}" in head, (
            f"{p.name}: header lacks its launch command"
        )


def test_examples_select_their_algorithm():
    """The recipes really configure what their name promises (guards against copy-paste drift)."""
    cfg = {p.stem: load_config(p, [f"model.path={EXAMPLES}"]) for p in EXAMPLE_FILES}
    assert cfg["drgrpo_addition"].algorithm.norm_adv_by_std_in_grpo is False
    assert cfg["drgrpo_addition"].actor.loss_agg_mode == "seq-mean-token-sum-norm"
    dapo = cfg["dapo_addition"]
    assert (
        dapo.actor.clip_ratio_high == 0.28
        and dapo.algorithm.filter_groups.enable
        and dapo.reward.overlong.enable
    )
    assert dapo.actor.loss_agg_mode == "token-mean"
    assert cfg["rloo_addition"].algorithm.adv_estimator == "rloo"
    assert cfg["reinforce_pp_addition"].algorithm.adv_estimator == "reinforce_plus_plus"
    assert cfg["reinforce_pp_addition"].algorithm.use_kl_in_reward
    assert cfg["gspo_addition"].actor.policy_loss == "gspo"
    assert cfg["ppo_gae_addition"].algorithm.adv_estimator == "gae"
    assert cfg["remax_addition"].algorithm.adv_estimator == "remax"
    osoff = cfg["one_step_off_addition"].trainer
    assert osoff.mode == "one_step_off" and osoff.async_.max_staleness == 1
    assert cfg["one_step_off_addition"].actor.policy_loss == "bypass_mode"
    fa = cfg["fully_async_addition"]
    assert fa.trainer.mode == "fully_async" and fa.trainer.async_.parameter_sync_step == 2
    assert fa.data.train_batch_size == 2 * fa.actor.ppo_mini_batch_size
    otb = cfg["otb_addition"]
    assert otb.algorithm.adv_estimator == "optimal_token_baseline"
    assert otb.algorithm.adv_estimator_kwargs == {"handle_zero_tail": True}
    rm = cfg["ppo_rm_addition"]
    assert (
        rm.algorithm.adv_estimator == "gae"
        and rm.reward.model.enable
        and rm.critic.model_path == rm.reward.model.path
    )
    assert all(c.rollout.n > 1 for c in cfg.values())


_HALF_CONSTANT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return 1.0  # every sample of this prompt scores the same: DAPO drops the group\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)
_ALL_CONSTANT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
)


@pytest.mark.parametrize(
    "reward,mini",
    [(_HALF_CONSTANT, 6), (_HALF_CONSTANT, 2), (_ALL_CONSTANT, 2)],
    ids=["half-dropped", "half-dropped-ragged-minibatch", "all-dropped"],
)
def test_dapo_dynamic_sampling_shrinks_the_batch(small_overrides, tmp_path, reward, mini):
    """Without refill, dropped groups shrink the batch (possibly below/off a mini-batch
    multiple, or to nothing)."""
    fn = tmp_path / "reward.py"
    fn.write_text(reward)
    ov = [
        *small_overrides,
        f"reward.custom_function.path={fn}",
        "data.val_files=[]",
        "trainer.total_steps=1",
        "data.train_batch_size=6",
        f"actor.ppo_mini_batch_size={mini}",
        "reward.overlong.enable=false",
        "algorithm.filter_groups.refill=false",
    ]  # the length penalty would make constant rewards differ
    trainer = RLTrainer(load_config(EXAMPLES / "dapo_addition.yaml", ov))
    try:
        before, last, after = fit_with_snapshots(trainer)
    finally:
        trainer.close()
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    if (
        reward is _ALL_CONSTANT
    ):  # nothing to learn: no optimizer step at all (AdamW would still move)
        assert (
            last["dynamic_sampling/num_kept_groups"] == 0
            and last["dynamic_sampling/skipped_update"] == 1
        )
        assert not moved
    else:
        assert last["dynamic_sampling/skipped_update"] == 0 and moved
    assert last["dynamic_sampling/num_groups"] == 6
    assert last["dynamic_sampling/num_dropped_groups"] >= 1
    assert (
        last["dynamic_sampling/num_kept_groups"] + last["dynamic_sampling/num_dropped_groups"] == 6
    )
    assert all(math.isfinite(v) for v in last.values()), last


def test_overlong_penalty_uses_the_configured_length_not_the_batch_width():
    """Short answers padded to a narrow batch are not punished; the ramp is over the configured
    max."""
    from types import SimpleNamespace

    from postrl.protocol import DataProto
    from postrl.reward import RewardResult, SampleScore
    from postrl.reward.stage import apply_reward_result

    lengths = torch.tensor([3, 2, 1])  # the batch is 3 tokens wide; the configured max is 16
    am = torch.cat(
        [torch.ones(3, 4, dtype=torch.long), (torch.arange(3)[None] < lengths[:, None]).long()], 1
    )
    batch = DataProto.from_dict(
        {
            "responses": torch.zeros(3, 3, dtype=torch.long),
            "attention_mask": am,
            "response_mask": am[:, -3:].clone(),
        }
    )
    result = RewardResult.from_samples(
        [SampleScore(1.0, None, None, {}) for _ in range(3)], ["a", "a", "a"]
    )
    ov = SimpleNamespace(enable=True, buffer_len=4, penalty_factor=1.0)
    out, m = apply_reward_result(batch, result, ov, max_response_length=16)
    assert m["reward/overlong_penalty/mean"] == 0.0
    assert out.batch["token_level_scores"].sum(-1).tolist() == [1.0, 1.0, 1.0]
    _, m = apply_reward_result(
        batch, result, ov, max_response_length=4
    )  # ramp over lengths 1..4: -len/4
    assert m["reward/overlong_penalty/mean"] == pytest.approx(-(3 / 4 + 2 / 4 + 1 / 4) / 3)
    with pytest.raises(ValueError, match="max_response_length"):
        apply_reward_result(batch, result, ov)


def test_example_data_paths_are_what_quickstart_writes():
    """Every data file a recipe reads under runs/quickstart/data/ is written by `make quickstart` or
    by a `postrl data` command in the recipe's own header."""
    import re

    source = (
        Path(__file__).resolve().parents[2] / "postrl" / "recipes" / "quickstart.py"
    ).read_text()
    for p in EXAMPLE_FILES:
        text = p.read_text()
        header = text.split("\nmodel:", 1)[0]
        body = text[len(header) :]
        for name in re.findall(r"runs/quickstart/data/([\w.]+)", body):
            made = f'"{name}"' in source or re.search(
                rf"postrl data \S+ runs/quickstart/data/{re.escape(name)}", header
            )
            assert made, (
                f"{p.name} reads runs/quickstart/data/{name}, "
                "which neither quickstart nor its header writes"
            )


def test_dapo_refills_dropped_groups_exactly(small_overrides, tmp_path):
    """Prompts with an even dataset index score a constant (DAPO drops their groups); every
    dropped group is replaced by one more prompt from the loader until the update sees
    ``train_batch_size`` informative groups — the batch never shrinks."""
    fn = tmp_path / "reward.py"
    fn.write_text(_HALF_CONSTANT)
    ov = [
        *small_overrides,
        f"reward.custom_function.path={fn}",
        "data.val_files=[]",
        "trainer.total_steps=2",
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=3",
        "reward.overlong.enable=false",
    ]
    trainer = RLTrainer(load_config(EXAMPLES / "dapo_addition.yaml", ov))
    seen: list[list[int]] = []
    update = trainer.roles.update_actor

    def spy(batch):
        idx = batch.non_tensor_batch["extra_info"]
        seen.append(sorted({int(e["index"]) for e in idx}))
        return update(batch)

    trainer.roles.update_actor = spy
    try:
        last = trainer.fit()
    finally:
        trainer.close()
    for groups in seen:  # a full batch of informative (odd-index) prompts, each once
        assert len(groups) == 6 and all(i % 2 == 1 for i in groups), groups
    assert last["dynamic_sampling/num_kept_groups"] == 6
    assert last["dynamic_sampling/gen_rounds"] >= 2  # at least one refill round
    assert last["dynamic_sampling/num_groups"] == 6 + last["dynamic_sampling/num_dropped_groups"]
    assert last["reward/generated"] == 4 * last["dynamic_sampling/num_groups"]  # n = 4
    assert last["dynamic_sampling/refill_exhausted"] == 0
    assert len(set(seen[0]) | set(seen[1])) == 12  # no prompt trained twice across the steps
