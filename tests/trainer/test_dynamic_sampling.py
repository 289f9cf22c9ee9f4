"""DAPO dynamic sampling in ``sync``: a step whose refill budget runs out trains on the groups it
kept, whatever order the groups finish in (regression: when the last group to finish was a kept
one, nothing woke the take and the step waited forever)."""

from __future__ import annotations

import pytest
from trainer_helpers import metric_rows

from postrl.config import load_config
from postrl.trainer.trainer import RLTrainer

# even sums: a varied score (the group is kept); odd sums: always 0 (the group is filtered)
HALF_FILTERED = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if int(ground_truth) % 2:\n"
    "        return 0.0\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("gen_batches", [1, 2])
def test_exhausted_refills_train_on_the_kept_groups(small_overrides, tmp_path, gen_batches):
    reward = tmp_path / "half.py"
    reward.write_text(HALF_FILTERED)
    steps = 12
    trainer = RLTrainer(
        load_config(
            None,
            small_overrides
            + [
                f"reward.custom_function.path={reward}",
                "algorithm.filter_groups.enable=true",
                f"algorithm.filter_groups.max_num_gen_batches={gen_batches}",
                f"trainer.total_steps={steps}",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
            ],
        )
    )
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [r for r in metric_rows(tmp_path / "run") if "dynamic_sampling/num_groups" in r]
    assert len(rows) == steps
    short = [r for r in rows if r["dynamic_sampling/refill_exhausted"]]
    assert short, "no step ran out of refills: the test does not exercise the short batch"
    for r in rows:
        kept, groups = r["dynamic_sampling/num_kept_groups"], r["dynamic_sampling/num_groups"]
        assert kept + r["dynamic_sampling/num_dropped_groups"] <= groups
        assert groups <= 4 * gen_batches  # the budget: (max_num_gen_batches - 1) x 4 refills
        assert kept <= 4
        assert r["dynamic_sampling/skipped_update"] == float(kept == 0)  # nothing kept: no update
