"""The reward stage scoring trajectories without their padded batch (``score_streamed``): the
same scores, validity, metrics and scored batch as ``finish`` on the assembled batch."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from postrl.agent.base import AgentLoopOutput
from postrl.agent.manager import AgentLoopManager
from postrl.reward import RewardLoop, RewardStage


def _trajectories(tok) -> tuple[list[AgentLoopOutput], list[dict]]:
    """Two groups of three: right, wrong and unparsable answers, a loop's own score, a failed
    own score, a tool reward, and lengths up to the overlong ramp."""
    texts = ["12", "13", "twelve and then some", "579", "579", "57"]
    extras: list[dict] = [
        {},
        {"tool_reward": 0.25},
        {},
        {"reward": 0.5},
        {},
        {"reward": {"error": "x"}},
    ]
    outs, rows = [], []
    for i, (text, extra) in enumerate(zip(texts, extras)):
        ids = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode(f"What is {i}?", add_special_tokens=False)
        outs.append(AgentLoopOutput(prompt, ids, [1] * len(ids), [-0.5] * len(ids), extra=extra))
        rows.append(
            {
                "uid": f"g{i // 3}",
                "sample_index": i % 3,
                "request_id": f"r{i}",
                "data_source": "addition",
                "ground_truth": "12" if i < 3 else "579",
                "extra_info": {},
            }
        )
    return outs, rows


@pytest.fixture
def parts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    loop = RewardLoop(num_workers=1)
    stage = RewardStage(
        loop,
        tok,
        overlong=SimpleNamespace(enable=True, buffer_len=4, penalty_factor=1.0),
        max_response_length=8,
        tool_reward_weight=0.5,
    )
    yield tok, stage, AgentLoopManager(None, tok, None)
    stage.close()


def _stream(stage, outs, rows) -> None:
    for out, row in zip(outs, rows):
        stage.on_trajectory(int(row["sample_index"]), out, row)


def test_streamed_scores_equal_finish_on_the_batch(parts):
    tok, stage, manager = parts
    outs, rows = _trajectories(tok)
    _stream(stage, outs, rows)
    streamed = stage.score_streamed(outs, rows)
    assert streamed is not None
    assert not stage.streamed([(r["uid"], r["sample_index"]) for r in rows])  # collected
    _stream(stage, outs, rows)  # the same scores, streamed again for finish
    want, want_metrics = stage.finish(manager.assemble(outs, rows), check_failures=False)
    assert streamed.scores.tolist() == want.batch["token_level_scores"].sum(-1).tolist()
    assert (
        streamed.valid.tolist()
        == want.batch["sample_valid"].tolist()
        == [True, True, True, True, True, False]
    )
    assert streamed.metrics == want_metrics
    assert want_metrics["reward/overlong_penalty/mean"] < 0  # the long answer was shaped
    assert want_metrics["reward/tool_reward/mean"] == pytest.approx(0.25 / 6)
    got = streamed.apply(manager.assemble(outs, rows))
    assert got.batch.keys() == want.batch.keys()
    for k in want.batch.keys():
        assert torch.equal(got.batch[k], want.batch[k]), k


def test_rows_the_batch_must_score_are_left_to_finish(parts):
    """A row not streamed (it must be decoded from the batch), a reward model, or a trajectory
    with ``segments`` needs the batch: ``score_streamed`` returns None and collects nothing."""
    tok, stage, _ = parts
    outs, rows = _trajectories(tok)
    _stream(stage, outs[:4], rows[:4])
    keys = [(r["uid"], r["sample_index"]) for r in rows]
    assert stage.score_streamed(outs, rows) is None  # rows 4 and 5: 5 is its loop's own
    assert len(stage.streamed(keys)) == 3  # nothing collected (row 3 scored itself)
    _stream(stage, outs[4:], rows[4:])
    seg = [dataclasses.replace(outs[0], segments=[outs[0]]), *outs[1:]]
    assert stage.score_streamed(seg, rows) is None
    stage.reward_model = object()  # any reward model scores from the batch
    assert stage.score_streamed(outs, rows) is None
    stage.reward_model = None
    assert stage.score_streamed(outs, rows) is not None
