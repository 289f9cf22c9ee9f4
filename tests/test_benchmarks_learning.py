"""``benchmarks/learning.py``: every arm is a valid config, and a seconds-long run of two arms
writes the table's inputs (curves by training time) and the plot. Correctness, never timing."""

from __future__ import annotations

import json

import pytest

from postrl.config import load_config, validate_config


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("learning")


def _arm_configs(recipe, arms, digits, tmp_path, model_dir):
    from postrl.data import generate_addition, write_parquet

    data = write_parquet(generate_addition(8, max_digits=digits), tmp_path / f"d{digits}.parquet")
    for arm, over in arms.items():
        paths = [f"model.path={model_dir}", f"data.train_files=[{data}]"]
        over = [o.replace("@TEACHER@", str(model_dir)) for o in over]  # the opd* arms' teacher
        cfg = load_config(recipe, [*paths, f"data.val_files=[{data}]", *over])
        validate_config(cfg, check_registries=True)
        yield arm, cfg


def test_every_arm_is_a_valid_config(bench, tmp_path, tiny_model_dir):
    for arm, cfg in _arm_configs(bench.RECIPE, bench.ARMS, 3, tmp_path, tiny_model_dir):
        assert cfg.trainer.time_budget_s == 600 and cfg.trainer.test_at_s, arm


def test_every_quickstart_arm_is_a_valid_config(bench, tmp_path, tiny_model_dir):
    for arm, cfg in _arm_configs(bench.QUICKSTART, bench.QS_ARMS, 1, tmp_path, tiny_model_dir):
        assert cfg.rollout.val_kwargs.temperature == 0 and cfg.rollout.val_kwargs.n == 1, arm
    with pytest.raises(SystemExit):  # an arm of the other task is refused by name
        bench.main(["--task", "quickstart", "--arms", "w1", "--work-dir", str(tmp_path / "w")])


def test_accuracy_at_a_mark_is_the_first_validation_past_it(bench):
    curve = [(0.0, 0.05), (61.0, 0.07), (119.0, 0.08), (121.0, 0.09)]
    assert bench.accuracy_at(curve, 60) == 0.07 and bench.accuracy_at(curve, 120) == 0.09
    assert bench.accuracy_at(curve, 900) == 0.09  # past the end: the last one


@pytest.mark.slow
def test_two_arms_run_and_write_curves_and_a_plot(bench, tiny_model_dir, tmp_path, capsys):
    work = tmp_path / "work"
    args = ["--arms", "w1", "pods", "--seeds", "0", "--budget-s", "1.5", "--marks", "0.5"]
    args += ["--model", str(tiny_model_dir), "--work-dir", str(work)]
    args += ["--train-size", "64", "--test-size", "16"]
    args += ["--extra", "rollout.response_length=4", "data.train_batch_size=4"]
    args += ["actor.ppo_mini_batch_size=4", "trainer.test_at_s=[0.5]"]
    assert bench.main(args) == 0
    res = json.loads((work / "results.json").read_text())
    for arm in ("w1", "pods"):
        curve = res["runs"][arm]["0"]["curve"]
        times = [t for t, _ in curve]
        assert times[0] == 0.0 and times[-1] >= 1.5 and len(curve) >= 2  # start, ..., end
        assert all(0.0 <= acc <= 1.0 for _, acc in curve)
    assert (work / "learning.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "w1" in table and "pods" in table
