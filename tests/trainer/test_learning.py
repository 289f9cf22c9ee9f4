"""The model learns: from the SFT-warmed tiny model, GRPO raises addition validation accuracy.

This is the quickstart pipeline at a reduced size (slow: about 2 minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_grpo_raises_validation_accuracy(tmp_path):
    from postrl.trainer.quickstart import main

    assert main(["--run-dir", str(tmp_path), "--sft-steps", "250", "--grpo-steps", "120",
                 "trainer.test_freq=30", "trainer.loggers=[jsonl]"]) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["val/acc/mean"] for r in rows if r.get("val/acc/mean") is not None}
    assert sorted(acc) == [0, 30, 60, 90, 120]
    # measured here: 0.28 at step 0, 0.38 at step 120 (200 sampled validation answers)
    assert acc[120] >= acc[0] + 0.05, acc
    assert max(acc[90], acc[120]) > max(acc[0], acc[30]), acc
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert sum(scores[-30:]) / 30 > sum(scores[:30]) / 30, "training reward did not rise"
