"""The model learns: from the SFT-warmed tiny model, GRPO raises addition validation accuracy.

This is the quickstart pipeline at a reduced size (slow: about 2 minutes on 2 cores).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_grpo_raises_validation_accuracy(tmp_path):
    from postrl.recipes.quickstart import main

    assert (
        main(
            [
                "--run-dir",
                str(tmp_path),
                "--sft-steps",
                "250",
                "--grpo-steps",
                "120",
                "trainer.test_freq=30",
                "trainer.loggers=[jsonl]",
            ]
        )
        == 0
    )
    rows = [json.loads(ln) for ln in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["val/acc/mean"] for r in rows if r.get("val/acc/mean") is not None}
    assert sorted(acc) == [0, 30, 60, 90, 120]
    # measured (session 3, seed 0): 0.165 at step 0; 0.285, 0.30, 0.305, 0.275 at 30..120
    # (200 held-out problems, one sampled answer each; seed 1: 0.155 -> 0.28..0.31). Where the
    # SFT warm-up ends differs by machine (float order in 250 steps at lr 3e-3): on an AVX-512
    # AMD EPYC the same run starts at 0.685 and reaches 0.75, 0.74, 0.79. So the bound is a
    # gain every machine shows (800 sampled answers per point: ±0.016 at 0.7, ±0.03 at 0.3):
    late = [acc[s] for s in (60, 90, 120)]
    assert sum(late) / 3 >= acc[0] + 0.05, acc
    assert max(late) >= acc[0] + 0.08, acc
    # The training prompts are pairs the SFT warm-up has seen: their reward starts near 0.27 and
    # GRPO does not reliably raise it within 120 steps (15-step means 0.27 -> 0.35 -> 0.28 here);
    # what it raises is held-out accuracy, asserted above. Here: the policy must not degrade.
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    assert sum(scores[-30:]) / 30 > sum(scores[:5]) / 5 - 0.05, "training reward collapsed"
