import json
import math
import time

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


def _wandb_records(path):
    """Protobuf records of a W&B run file (LevelDB-log framing: 32 KiB blocks, 7-byte headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST add
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r


def _read_wandb_run(run_dir):
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    history, config, runs = [], {}, []
    for f in files:
        for r in _wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = r.history.item
                history.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
            elif kind in ("run", "config"):
                updates = r.run.config.update if kind == "run" else r.config.update
                config.update({i.key: json.loads(i.value_json) for i in updates})
                if kind == "run":
                    runs.append((r.run.project, r.run.display_name, r.run.run_id))
    return history, config, runs


def test_wandb_sink_offline_writes_config_and_verl_metric_names(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from postrl.config import load_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["trainer.project_name=proj", "trainer.experiment_name=exp1"])
    t = Tracker(tmp_path, ["wandb"], total_steps=2, config=cfg)
    t.log({"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "timing_s/gen": 1.5}, 1)
    t.log({"critic/score/mean": 0.75, "actor/pg_loss": -0.5, "timing_s/gen": 1.25}, 2)
    t.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    # resuming the postrl run continues the same W&B run
    t2 = Tracker(tmp_path, ["wandb"], total_steps=3, config=cfg, start_step=3)
    t2.log({"critic/score/mean": 1.0}, 3)
    t2.close()
    # W&B's service process writes the run file; on a loaded 2-core CI machine the resumed run's
    # last record has been seen to land after finish() returned: wait for it, with a deadline
    deadline = time.monotonic() + 30
    while True:
        history, config, runs = _read_wandb_run(tmp_path)
        if len(history) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {r for r in runs} == {("proj", "exp1", run_id)}
    steps = [(h["_step"], h["critic/score/mean"]) for h in history]
    assert steps == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert history[0]["actor/pg_loss"] == -0.25 and history[1]["timing_s/gen"] == 1.25
    # the resolved postrl config is the run config
    assert config["trainer"]["experiment_name"] == "exp1" and config["rollout"]["n"] == 8
