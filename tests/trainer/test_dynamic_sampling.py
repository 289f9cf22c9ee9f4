"""DAPO dynamic sampling in ``sync``: a step whose refill budget runs out trains on the groups it
kept, whatever order the groups finish in (regression: when the last group to finish was a kept
one, nothing woke the take and the step waited forever)."""

from __future__ import annotations

import pytest
from trainer_helpers import assert_same_run, metric_rows

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


# even rows: a constant score (the group is filtered); odd rows: a score that differs between
# any two distinct responses, so their groups are kept (a tie of all n is ~97^-(n-1))
_EVEN_FILTERED = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return 1.0\n"
    "    return sum(map(ord, solution_str)) % 97 / 97\n"
)


def _oversample_args(tiny_model_dir, files, tmp_path, run) -> list[str]:
    reward = tmp_path / "even_filtered.py"
    reward.write_text(_EVEN_FILTERED)
    train, test = files
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=4",
        "rollout.response_length=8",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.oversample=true",
        "trainer.total_steps=6",  # three epochs of the 8 odd rows
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"reward.custom_function.path={reward}",
        f"trainer.run_dir={run}",
    ]


def _odd_rows_once_per_epoch(run, epochs: int) -> None:
    """Epochs 0 .. epochs-1: every odd row trained exactly once, no even row ever (filtered),
    whatever the oversampling left over and generated again."""
    from collections import Counter

    from postrl.trainer.ledger import read_ledger

    rows = read_ledger(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    trained = [
        (i, e) for r in rows for i, e in zip(r["index"], r.get("epochs") or [r["epoch"]] * 4)
    ]
    assert not [i for i, _ in trained if i % 2 == 0], "a filtered (constant-score) row trained"
    for epoch in range(epochs):
        got = Counter(i for i, e in trained if e == epoch)
        assert got == Counter(range(1, 16, 2)), f"epoch {epoch}: odd rows trained {got}"


@pytest.mark.timeout(180)
def test_oversampling_keeps_more_groups_in_flight_and_loses_no_prompt(
    tiny_model_dir, epoch_files, tmp_path
):
    """``oversample``: a step keeps ⌈missing / keep rate⌉ groups in flight (here the keep rate
    is ½: twice the missing groups), the groups left over when the batch is full are evicted as
    ``surplus`` and generated again first — every odd row is still trained once per epoch."""
    from trainer_helpers import train_subprocess

    run = tmp_path / "run"
    args = _oversample_args(tiny_model_dir, epoch_files, tmp_path, run)
    assert train_subprocess(args, threads=1) == 0
    rows = [r for r in metric_rows(run) if "dynamic_sampling/num_groups" in r]
    assert len(rows) == 6
    assert sum(r["replay/evicted/surplus"] for r in rows) > 0, "nothing left over: not exercised"
    # refills per step: without oversampling one per filtered group (= the dropped count); with
    # it more, once the measured keep rate is below 1
    assert any(r["replay/refills"] > r["dynamic_sampling/num_dropped_groups"] for r in rows)
    assert all(r["dynamic_sampling/num_kept_groups"] == 4 for r in rows)
    _odd_rows_once_per_epoch(run, epochs=2)


@pytest.mark.timeout(180)
def test_filtered_groups_are_never_padded_into_a_batch(tiny_model_dir, epoch_files, tmp_path):
    """Scores streamed as trajectories finish decide the filter before any padding: only the
    groups a step trains are assembled into a batch (``RewardStage.score_streamed``), and what
    they train on is what scoring the assembled batch gives (the custom reward's own score)."""
    run = tmp_path / "run"
    args = [*_oversample_args(tiny_model_dir, epoch_files, tmp_path, run), "trainer.save_freq=0"]
    trainer = RLTrainer(load_config(None, [*args, "trainer.total_steps=3"]))
    runner = trainer.ctx.runner
    assemble, scored, padded, trained = runner.agents.assemble, [], [], []
    score_groups = runner.score_groups

    def count_scored(groups):
        scored.extend(g[0].row["uid"] for g in groups)
        return score_groups(groups)

    def count_padded(outputs, rows):
        padded.extend(dict.fromkeys(r["uid"] for r in rows))  # each group's uid once
        return assemble(outputs, rows)

    def update(batch):
        nt = batch.non_tensor_batch
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        trained.extend(zip(nt["uid"].tolist(), nt["index"].tolist(), scores))
        return actor_update(batch)

    runner.score_groups, runner.agents.assemble = count_scored, count_padded
    actor_update, trainer.roles.update_actor = trainer.roles.update_actor, update
    try:
        trainer.fit()
    finally:
        trainer.close()
    kept = {uid for uid, _, _ in trained}
    assert len(kept) == 3 * 4 and len(scored) > len(kept)  # some groups were filtered out
    padded = [u for u in padded if not u.startswith("-1-")]  # the final validation's groups
    assert sorted(padded) == sorted(kept)  # each trained group padded once, no other
    for _, index, score in trained:  # the odd rows' score: the custom function's, not 1.0
        assert int(index) % 2 == 1 and 0.0 <= score < 1.0


@pytest.mark.timeout(180)
def test_greso_skips_prompts_dynamic_sampling_filtered_before_generating_them(
    tiny_model_dir, epoch_files, tmp_path
):
    """``data.sampler=greso`` with dynamic sampling: the groups the filter throws away (even
    rows: all score 1) reach the sampler, so from the second epoch on such prompts are mostly
    skipped before rollout — counted as easy skips — while every odd row (signal) is still
    trained once per epoch."""
    from trainer_helpers import train_subprocess

    run = tmp_path / "run"
    args = [
        *_oversample_args(tiny_model_dir, epoch_files, tmp_path, run),
        "data.sampler=greso",
        "data.sampler_kwargs={explore: 0.2, explore_min: 0.2}",
    ]
    assert train_subprocess(args, threads=1) == 0
    rows = [r for r in metric_rows(run) if "sampler/skipped" in r]
    assert len(rows) == 6
    assert sum(r["sampler/skipped_easy"] for r in rows) > 0, "filtered groups not observed"
    assert sum(r["sampler/skipped_hard"] for r in rows) == 0
    _odd_rows_once_per_epoch(run, epochs=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_oversampling_kill_and_resume_loses_no_prompt(tiny_model_dir, epoch_files, tmp_path):
    """SIGKILL right after a checkpoint taken with surplus prompts waiting to be generated
    again (they live in the mode's checkpoint), resume: every odd row is still trained exactly
    once per epoch. The kill point is the step after the first one that left a surplus."""
    from trainer_helpers import train_subprocess

    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train_subprocess(_oversample_args(tiny_model_dir, epoch_files, tmp_path, ref), 1) == 0
    surplus = [r["step"] for r in metric_rows(ref) if r.get("replay/evicted/surplus")]
    assert surplus and surplus[0] < 6, f"no surplus before the last step ({surplus})"
    args = _oversample_args(tiny_model_dir, epoch_files, tmp_path, run)
    assert train_subprocess(args, threads=1, kill_at=f"step{surplus[0] + 1}:after_gen") == -9
    assert train_subprocess(args, threads=1) == 0
    _odd_rows_once_per_epoch(run, epochs=2)
    # and exactly the uninterrupted run: the groups scored as they complete, their filtered
    # refills and the surplus carried in the checkpoint replay in the same order
    assert_same_run(ref, run, 6)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_oversampling_on_the_object_store_plane_loses_no_prompt(
    tiny_model_dir, epoch_files, tmp_path
):
    """The same run with Ray workers and the replicas scoring groups into the object store:
    surplus groups are cancelled on the replicas and generated again all the same. (Until the
    loader drew across an epoch's end, a draw there skipped the epoch's last prompts — rows 1
    and 15 of epoch 0 in two of three runs of this test.)"""
    pytest.importorskip("ray")
    from trainer_helpers import train_subprocess

    run = tmp_path / "run"
    args = [
        *_oversample_args(tiny_model_dir, epoch_files, tmp_path, run),
        "trainer.backend=ray",
        "trainer.num_workers=1",
        "trainer.async.data_plane=object_store",
    ]
    assert train_subprocess(args, threads=1) == 0
    rows = [r for r in metric_rows(run) if "dynamic_sampling/num_groups" in r]
    # completion order on the replicas is not fixed: whether a step leaves a surplus is timing;
    # that oversampling admitted beyond the drops is not
    assert sum(r["replay/refills"] for r in rows) > sum(
        r["dynamic_sampling/num_dropped_groups"] for r in rows
    )
    _odd_rows_once_per_epoch(run, epochs=2)


def test_oversample_config_errors_name_the_fix(small_overrides):
    """``oversample`` needs a mode that declares it; without filtering it has no effect."""
    from postrl.config.loader import ConfigError

    cfg = load_config(None, [*small_overrides, "algorithm.filter_groups.oversample=true"])
    assert cfg.algorithm.filter_groups.oversample  # no filtering: valid, nothing to size
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [
                    *small_overrides,
                    "trainer.mode=one_step_off",
                    "algorithm.filter_groups.enable=true",
                    "algorithm.filter_groups.oversample=true",
                ],
            )
        )
    assert "oversample=true with trainer.mode=one_step_off" in str(e.value)


@pytest.mark.timeout(90)
def test_one_draw_holding_a_row_twice_admits_two_groups(small_overrides, tmp_path):
    """A draw across an epoch's end can hold the same row twice: at the end of epoch e and at
    the start of e+1. Each is a group of its own (own uid, request ids and seeds), and both are
    trained. (Regression: both got uid ``"{step}-{index}"`` and the admission failed with
    "group uids admitted twice" — seen once in CI on the object-store oversampling run.)"""
    import numpy as np

    trainer = RLTrainer(load_config(None, small_overrides + ["data.train_batch_size=2"]))
    try:
        stream = trainer.mode.stream
        prompts = trainer.loader.dataset.batch(np.asarray([3, 3]))
        prompts.meta_info["epoch"], prompts.meta_info["epochs"] = 1, [0, 1]
        trainer.ctx.fleet.wake_up()
        uids = stream.admit(prompts, 1)
        assert len(set(uids)) == 2 and uids[0] == "1-3", uids
        groups = [stream.buffer.group(u) for u in uids]
        assert [g.epoch for g in groups] == [0, 1] and [g.index for g in groups] == [3, 3]
        seeds = [[r["seed"] for r in stream._rows[u]] for u in uids]
        assert not set(seeds[0]) & set(seeds[1]), "the second group would copy the first"
        batch, _ = stream.take(2, 1, trainer.loader.next_prompts)
        assert sorted(set(batch.non_tensor_batch["uid"].tolist())) == sorted(uids)
        assert len(batch) == 2 * 4
    finally:
        trainer.close()
