"""``SamplingParams.evolve`` and ``TrajectoryTag.replace``: the per-request copies equal
``dataclasses.replace``'s, keep their checks, and refuse unknown fields."""

from __future__ import annotations

import dataclasses

import pytest

from postrl.rollout import SamplingParams
from postrl.trainer.asynchronous.replay.tags import TrajectoryStatus, TrajectoryTag


def test_evolve_is_replace_with_the_checks_where_they_apply():
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, stop_token_ids=(2,))
    assert sp.evolve(seed=None, priority=0) is sp  # nothing changes: no copy
    for changes in ({"seed": 5, "priority": 3}, {"max_new_tokens": 4, "continued": 2}):
        new = sp.evolve(**changes)
        assert new == dataclasses.replace(sp, **changes) and new is not sp
    assert sp.seed is None and sp.max_new_tokens == 8  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.evolve(seed=1).seed = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_new_tokens=0"):  # a checked field: checked
        sp.evolve(max_new_tokens=0)
    with pytest.raises(TypeError, match="seeds"):
        sp.evolve(seeds=1)


def test_a_tags_replace_is_dataclasses_replace():
    tag = TrajectoryTag("g", 3, dispatch_step=2)
    new = tag.replace(status=TrajectoryStatus.RUNNING, response_len=7)
    assert new == dataclasses.replace(tag, status=TrajectoryStatus.RUNNING, response_len=7)
    assert tag.status is TrajectoryStatus.PENDING and new.key == ("g", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.score = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="statu"):
        tag.replace(statu=TrajectoryStatus.RUNNING)
