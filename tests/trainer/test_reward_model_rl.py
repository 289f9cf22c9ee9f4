"""GRPO with a learned reward model (``reward.model``): replace and add modes, failure handling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from postrl.config import ConfigError, load_config, validate_config
from postrl.reward.stage import combine_scores
from postrl.reward.types import RewardResult, SampleScore, failed
from postrl.testing import make_model
from postrl.trainer.trainer import RLTrainer


def test_reward_model_result_replace_and_add():
    rm = torch.tensor([0.5, float("nan"), -1.0, 2.0])
    r = combine_scores(None, rm, ["a", "b", "c", "d"])
    assert r.valid.tolist() == [True, False, True, True]  # a NaN score is a failure, not a number
    assert r.failure_reason[1] == "nan" and r.scores.tolist() == [0.5, 0.0, -1.0, 2.0]
    rule = RewardResult.from_samples(
        [
            SampleScore(1.0, extra={"acc": 1}),
            SampleScore(0.0),
            failed("timeout", "slow"),
            SampleScore(0.0, extra={"acc": 0}),
        ],
        ["a", "b", "c", "d"],
    )
    s = combine_scores(rule, rm, ["a", "b", "c", "d"])
    assert s.valid.tolist() == [True, False, False, True]
    assert s.scores.tolist() == [1.5, 0.0, 0.0, 2.0]
    assert s.failure_reason[1:3] == ["nan", "timeout"]
    assert s.extra["acc"] == [1, None, None, 0]
    assert s.metrics["reward/failed/total"] == 2 and s.metrics["reward/scored"] == 2


def test_reward_model_config_is_validated(tiny_model_dir):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "data.train_files=[x.parquet]",
            "reward.model.enable=true",
            "reward.model.mode=mix",
            "reward.model.micro_batch_size=0",
        ],
    )
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_files=False)
    msg = str(e.value)
    assert (
        "reward.model.path is empty" in msg
        and "reward.model.mode='mix'" in msg
        and "micro_batch_size=0" in msg
    )


def _fit(cfg) -> dict[str, float]:
    """Validate ``cfg``, train, close; the last step's metrics."""
    validate_config(cfg)
    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rm") / "rm", head="reward", seed=4)


@pytest.mark.parametrize("mode", ["replace", "add"])
def test_grpo_with_reward_model(small_overrides, rm_dir, mode):
    """The step scores every trajectory with the reward model; in ``replace`` mode the reward is
    its score (times ``weight``), in ``add`` mode the rule reward plus it; metrics report it."""
    cfg = load_config(
        None,
        [
            *small_overrides,
            "reward.model.enable=true",
            f"reward.model.path={rm_dir}",
            f"reward.model.mode={mode}",
            "reward.model.weight=10.0",
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
        ],
    )
    last = _fit(cfg)
    rows = [
        json.loads(ln)
        for ln in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train = [r for r in rows if "reward_model/score/mean" in r]
    assert len(train) == 2
    for r in train:
        assert r["reward_model/truncated"] == 0 and r["timing_s/reward_model"] > 0
        assert r["reward/generated"] == 16 == r["reward/scored"]
        rm_mean = 10.0 * r["reward_model/score/mean"]
        if mode == "replace":
            assert r["critic/score/mean"] == pytest.approx(rm_mean, abs=1e-5)
        else:  # rule (exact answer: 0 or 1 per sample) + weighted RM score
            rule_mean = r["critic/score/mean"] - rm_mean
            assert -1e-5 <= rule_mean <= 1 + 1e-5
            assert math.isclose(rule_mean * 16, round(rule_mean * 16), abs_tol=1e-3)
    assert "val/acc/mean" in last  # validation still reports the task's rule metric
    assert "val/reward_model/score" in last


def test_preference_only_data_trains_and_validates_on_the_reward_model(
    small_overrides, addition_files, rm_dir, tmp_path
):
    """A data_source with no reward function: replace mode needs none, validation reports the RM
    score only; add mode fails loudly for it."""
    from postrl.data import write_parquet
    from postrl.data.tasks import read_rows

    files = []
    for f in addition_files:
        rows = [{**r, "data_source": "chat_prefs"} for r in read_rows(str(f))]
        files.append(write_parquet(rows, tmp_path / Path(f).name))
    over = [o for o in small_overrides if not o.startswith(("data.train_files", "data.val_files"))]
    common = [
        *over,
        f"data.train_files=[{files[0]}]",
        f"data.val_files=[{files[1]}]",
        "reward.model.enable=true",
        f"reward.model.path={rm_dir}",
        "trainer.total_steps=1",
    ]
    trainer = RLTrainer(load_config(None, common))
    try:
        last = trainer.fit()
    finally:
        trainer.close()
    assert "val/reward_model/score" in last and "val/acc/mean" not in last
    assert last["reward/scored"] == 16 and math.isfinite(last["critic/score/mean"])
    trainer = RLTrainer(
        load_config(None, [*common, "reward.model.mode=add", "trainer.val_before_train=false"])
    )
    try:
        with pytest.raises(Exception, match="chat_prefs"):
            trainer.fit()
    finally:
        trainer.close()


def test_ppo_with_reward_model_and_critic_initialised_from_it(small_overrides, rm_dir):
    """InstructGPT-style PPO: GAE with a critic whose backbone and value head start as the reward
    model's (``critic.model_path``); its first values equal the RM's score of each prefix."""
    from postrl.config.schema import ModelConfig
    from postrl.engine.model import load_critic
    from postrl.engine.reward_model import RewardModel

    critic = load_critic(ModelConfig(path=str(rm_dir)))
    rm = RewardModel(rm_dir)
    torch.testing.assert_close(critic.value_head.weight, rm.model.score.weight)
    prompts, rest = [[5, 6, 7], [5, 6, 7]], [[8, 9], [10]]
    scores = rm.score_split(prompts, rest)  # score at the last token of each sequence
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        values = critic(ids, mask, 3)  # value of response token t = state that predicts it
    torch.testing.assert_close(values[[0, 1], [2, 1]], scores, atol=1e-5, rtol=1e-5)

    cfg = load_config(
        None,
        [
            *small_overrides,
            "algorithm.adv_estimator=gae",
            "critic.optim.lr=1e-4",
            "reward.model.enable=true",
            f"reward.model.path={rm_dir}",
            f"critic.model_path={rm_dir}",
            "trainer.total_steps=1",
            "trainer.val_before_train=false",
            "data.val_files=[]",
        ],
    )
    last = _fit(cfg)
    assert math.isfinite(last["critic/vf_loss"]) and "reward_model/score/mean" in last
