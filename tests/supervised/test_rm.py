"""``postrl rm``: Bradley–Terry reward-model training on preference pairs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from postrl.data import preference_pairs, write_parquet
from postrl.data.tasks import TASKS, read_rows
from postrl.engine.reward_model import RewardModel
from postrl.supervised.rm import run_rm


def test_preference_pairs_from_addition_rows():
    rows = TASKS["addition"](300, seed=0)
    pairs = preference_pairs(rows, seed=1)
    assert len(pairs) == 300
    for r, p in zip(rows, pairs):
        assert p["prompt"] == list(r["prompt"]) and p["chosen"] == r["reward_model"]["ground_truth"]
        wrong = int(p["rejected"])
        assert wrong >= 0 and 1 <= abs(wrong - int(p["chosen"])) <= 9
    with pytest.raises(ValueError, match="not an integer"):
        preference_pairs([{"prompt": [], "reward_model": {"ground_truth": "x+1"}}])


def test_rm_learns_a_preference_and_scores_it_at_rl_time(tiny_model_dir, tmp_path):
    """A learnable preference (a number over a word): held-out accuracy 1, the loss falls from
    ≈log 2 to near 0, and the written model — a one-label sequence classifier with the policy's
    tokenizer — ranks the pairs the same way through the RL-time scorer."""
    rows = [
        {**p, "rejected": "banana"}
        for p in preference_pairs(TASKS["addition"](400, seed=3), seed=3)
    ]
    data = write_parquet(rows, tmp_path / "pairs.parquet")
    m = run_rm(
        str(tiny_model_dir),
        str(data),
        str(tmp_path / "rm"),
        lr=1e-3,
        batch_size=16,
        max_steps=40,
        eval_fraction=0.2,
        warmup_steps=5,
        log_every=0,
    )
    assert m["rm/eval_acc"] == 1.0 and m["rm/eval_pairs"] == 80
    assert m["rm/final_loss"] < 0.1 < m["rm/first_loss"]
    assert (tmp_path / "rm" / "rm_metrics.json").exists()
    rm = RewardModel(tmp_path / "rm")
    probe = rows[:8]
    good, _ = rm.score([p["prompt"] for p in probe], [p["chosen"] for p in probe])
    bad, _ = rm.score([p["prompt"] for p in probe], [p["rejected"] for p in probe])
    assert bool((good > bad).all())


def test_rm_rejects_rows_without_pairs(tiny_model_dir, tmp_path):
    data = write_parquet(TASKS["addition"](20, seed=0), tmp_path / "rl.parquet")
    with pytest.raises(ValueError, match="need prompt, chosen, rejected"):
        run_rm(str(tiny_model_dir), str(data), str(tmp_path / "rm"))


def test_cli_writes_pairs(tmp_path):
    out = tmp_path / "p.parquet"
    subprocess.run(
        [sys.executable, "-m", "postrl.cli", "data", "addition", str(out), "--n", "12", "--pairs"],
        check=True,
        capture_output=True,
    )
    rows = read_rows(str(out))
    assert len(rows) == 12 and {"prompt", "chosen", "rejected"} <= set(rows[0])
    r = subprocess.run(
        [sys.executable, "-m", "postrl.cli", "rm", "lr=1e-3"], capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    for key in ("model_path", "train_file", "out_dir"):
        assert f"{key}: required" in r.stderr, r.stderr
