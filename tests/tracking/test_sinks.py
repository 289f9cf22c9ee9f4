import json
import math

import pytest

from postrl.tracking import METRIC_SINKS, Tracker, make_plots, summarize


def test_jsonl_rows_nan_as_null_and_resume_truncation(tmp_path):
    t = Tracker(tmp_path, ["jsonl"], total_steps=3)
    t.log({"critic/score/mean": 0.5, "actor/pg_loss": float("nan"), "text": "ignored"}, 1)
    t.log({"critic/score/mean": 0.7}, 2)
    t.close()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "actor/pg_loss": None, "critic/score/mean": 0.5},
        {"step": 2, "critic/score/mean": 0.7},
    ]
    # a resume at step 2 drops the rows of steps >= 2 and keeps the history before it
    t2 = Tracker(tmp_path, ["jsonl"], total_steps=3, start_step=2)
    assert [r["step"] for r in t2.history] == [1.0] and math.isnan(t2.history[0]["actor/pg_loss"])
    t2.log({"critic/score/mean": 0.9}, 2)
    t2.close()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["critic/score/mean"] == 0.9
    assert make_plots(tmp_path)[0].name == "reward.png"
    assert "critic/score/mean: first 0.5 → last 0.9" in summarize(tmp_path)


def test_unknown_sink_lists_choices(tmp_path):
    with pytest.raises(KeyError, match="did you mean 'jsonl'"):
        Tracker(tmp_path, ["jsonll"], total_steps=1)
    assert {"console", "jsonl", "tensorboard", "wandb"} <= set(METRIC_SINKS.names())


def test_tensorboard_sink_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    t = Tracker(tmp_path, ["tensorboard"], total_steps=1)
    t.log({"critic/score/mean": 1.0}, 1)
    t.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
