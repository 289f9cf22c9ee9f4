"""``trainer.mode=one_step_off``: generation one batch ahead of training, partial rollout,
staleness in policy versions, nothing lost or duplicated across kills, deterministic resume."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from trainer_helpers import (
    checkpoint_weights,
    each_prompt_once_per_epoch,
    metric_rows,
    train_subprocess,
)

from postrl.config import ConfigError, load_config
from postrl.trainer import RLTrainer


def _base(tiny_model_dir, epoch_files, digits_reward, run) -> list[str]:
    train, test = epoch_files
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-4",
        "actor.policy_loss=decoupled",
        "rollout.n=4",
        "rollout.response_length=8",
        "trainer.mode=one_step_off",
        "trainer.total_steps=8",  # two epochs
        "trainer.test_freq=4",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"reward.custom_function.path={digits_reward}",
        f"trainer.run_dir={run}",
    ]


def _fit_seeing(trainer: RLTrainer, see) -> None:
    """``trainer.fit()`` with ``see(batch)`` called on every batch the actor updates on."""
    update = trainer.roles.update_actor

    def spy(batch):
        see(batch)
        return update(batch)

    trainer.roles.update_actor = spy
    try:
        trainer.fit()
    finally:
        trainer.close()


def _each_prompt_once_per_epoch(run, epochs: int = 2, size: int = 16) -> None:
    each_prompt_once_per_epoch(run, epochs, size, steps_per_epoch=4)


@pytest.mark.parametrize("order", ["completion", "admission"])
def test_one_step_off_trains_each_prompt_once_within_the_staleness_bound(
    tiny_model_dir, epoch_files, digits_reward, tmp_path, order
):
    cfg = load_config(
        None,
        [
            *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
            "trainer.deterministic=true",
            f"trainer.async.take_order={order}",
        ],
    )
    trainer = RLTrainer(cfg)
    seen = []

    def spy(batch):
        v = batch.batch["rollout_policy_version"]
        mask = batch.batch["response_mask"].bool()
        seen.append((trainer.ctx.fleet.version, v[mask].min().item(), v, mask))

    _fit_seeing(trainer, spy)
    _each_prompt_once_per_epoch(tmp_path / "run")
    rows = metric_rows(tmp_path / "run")
    assert max(r["replay/staleness/max"] for r in rows) <= 1
    assert rows[-1]["replay/staleness/mean"] == 1.0  # generated one version ahead
    mixed = 0
    for current, oldest, v, mask in seen:
        assert current - oldest <= 1, "a token older than trainer.async.max_staleness was trained"
        rows_v = torch.where(mask, v, torch.full_like(v, -1))
        lo = torch.where(mask, v, torch.full_like(v, 1 << 30)).min(-1).values
        mixed += int(((rows_v.max(-1).values > lo) & mask.any(-1)).sum())
    assert mixed > 0, "no trajectory was interrupted and resumed on newer weights"
    assert sum(r["async/interrupted_trajectories"] for r in rows) > 0


def test_one_step_off_config_errors_name_the_field_and_the_fix(small_overrides):
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [*small_overrides, "trainer.mode=one_step_off", "trainer.async.max_staleness=0"],
            )
        )
    assert "trainer.async.max_staleness=0 with trainer.mode=one_step_off" in str(e.value)
    assert "set trainer.async.max_staleness >= 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, [*small_overrides, "trainer.async.max_stalenes=2"])
    assert "trainer.async.max_staleness" in str(e.value)  # did-you-mean, under the YAML key
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [
                    *small_overrides,
                    "trainer.mode=one_step_off",
                    "trainer.async.num_warmup_batches=1",
                    "trainer.async.staleness_strategy=keep",
                    "trainer.sampler=newest",
                ],
            )
        )
    msg = str(e.value)
    assert "set trainer.async.max_staleness >= 2" in msg
    assert "trainer.async.staleness_strategy='keep' must be 'drop'" in msg
    assert "trainer.sampler='newest'" in msg
    for bad, want in (
        (["trainer.async.take_order=first"], "trainer.async.take_order='first' must be"),
        (
            ["trainer.async.take_order=admission", "trainer.sampler=my_pkg.samplers:Longest"],
            "does not consult a sampler; use trainer.async.take_order=completion",
        ),
    ):
        with pytest.raises(ConfigError) as e:
            RLTrainer(load_config(None, [*small_overrides, "trainer.mode=one_step_off", *bad]))
        assert want in str(e.value)
    with pytest.raises(ConfigError) as e:
        RLTrainer(
            load_config(
                None,
                [*small_overrides, "trainer.mode=one_step_off", "actor.fuse_old_log_prob=true"],
            )
        )
    assert "off-policy" in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_at", ["step3:after_gen", "step6:after_update", "step4:ckpt_components"]
)
def test_one_step_off_kill_and_resume_loses_and_duplicates_nothing(
    tiny_model_dir, epoch_files, digits_reward, tmp_path, kill_at
):
    """SIGKILL mid-rollout, mid-update (the next batch in flight) and mid-save, then resume:
    every prompt of both epochs is trained exactly once, counted by uid and index."""
    run = tmp_path / "run"
    args = [*_base(tiny_model_dir, epoch_files, digits_reward, run), "trainer.save_freq=2"]
    assert train_subprocess(args, threads=1, kill_at=kill_at) == -9
    assert train_subprocess(args, threads=1) == 0
    _each_prompt_once_per_epoch(run)


@pytest.mark.slow
def test_deterministic_one_step_off_resume_is_bit_exact(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """With trainer.deterministic=true the resumed run logs the uninterrupted run's metrics
    and ends with its weights, bit for bit."""

    def args(run):
        return [
            *_base(tiny_model_dir, epoch_files, digits_reward, run),
            "trainer.total_steps=6",
            "trainer.save_freq=2",
            "trainer.deterministic=true",
        ]

    ref, run = tmp_path / "ref", tmp_path / "run"
    assert train_subprocess(args(ref), threads=1) == 0
    assert train_subprocess(args(run), threads=1, kill_at="step3:after_update") == -9
    assert train_subprocess(args(run), threads=1) == 0
    assert metric_rows(run) == metric_rows(ref)
    a, b = checkpoint_weights(run, 6), checkpoint_weights(ref, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_EVEN_CONSTANT = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 2 == 0:\n"
    "        return 1.0  # no signal: DAPO evicts the group\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)
# one row in four: at most 4 of an epoch's 16 rows fail, so the guard against a broken reward
# (more failed groups than the batch while gathering one, counted with the batch generated
# ahead) cannot trip whatever order the groups complete in; with even rows it could
_QUARTER_FAILS = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    if extra_info['index'] % 4 == 0:\n"
    "        raise ValueError('this reward fails on every fourth row')\n"
    "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
)


def _spy_updates(trainer):
    seen = []
    update = trainer.roles.update_actor

    def spy(batch):
        nt = batch.non_tensor_batch
        seen.append((Counter(str(u) for u in nt["uid"]), [int(i) for i in nt["index"]]))
        return update(batch)

    trainer.roles.update_actor = spy
    return seen


@pytest.mark.parametrize(
    "reward, evicted, period", [(_EVEN_CONSTANT, "filtered", 2), (_QUARTER_FAILS, "failed", 4)]
)
def test_filtered_and_failed_groups_are_evicted_and_refilled_exactly(
    tiny_model_dir, epoch_files, tmp_path, reward, evicted, period
):
    """DAPO's uninformative groups and groups past reward.max_failure_ratio are evicted whole
    and refilled: every update sees train_batch_size complete groups, none from the rows the
    reward singles out (``index % period == 0``)."""
    fn = tmp_path / "reward.py"
    fn.write_text(reward)
    ov = [
        *_base(tiny_model_dir, epoch_files, fn, tmp_path / "run"),
        "trainer.total_steps=2",
        "data.val_files=[]",
        "reward.max_failure_ratio=0.0",
        f"algorithm.filter_groups.enable={evicted == 'filtered'}",
        "trainer.async.score_on_completion=true",  # (a failed group is evicted only then)
    ]
    trainer = RLTrainer(load_config(None, ov))
    seen = _spy_updates(trainer)
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert len(seen) == 2
    for groups, index in seen:
        assert len(groups) == 4 and set(groups.values()) == {4}, "a partial or missing group"
        assert all(i % period for i in index), index
    rows = metric_rows(tmp_path / "run")
    assert sum(r[f"replay/evicted/{evicted}"] for r in rows) > 0
    assert sum(r["replay/refills"] for r in rows) == sum(
        r[f"replay/evicted/{evicted}"] for r in rows
    )  # one refill per evicted group


@pytest.mark.parametrize(
    "at_completion, message",
    [(True, "evicted for reward failures"), (None, "samples failed to score")],
)
def test_a_reward_that_always_fails_stops_the_run(
    tiny_model_dir, epoch_files, tmp_path, at_completion, message
):
    """Scored at completion, the failed groups are evicted until more fail than a batch holds;
    scored at the take (the default without filtering), the step's reward stage stops the run
    as ``sync``'s does."""
    from postrl.reward import RewardFailureError

    fn = tmp_path / "broken.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('x')\n"
    )
    ov = [
        *_base(tiny_model_dir, epoch_files, fn, tmp_path / "run"),
        "data.val_files=[]",
        f"trainer.async.score_on_completion={'null' if at_completion is None else at_completion}",
    ]
    trainer = RLTrainer(load_config(None, ov))
    try:
        with pytest.raises(RewardFailureError, match=message):
            trainer.fit()
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_score_on_completion_resolves_to_where_the_scores_are_needed(mode):
    """Unset, ``trainer.async.score_on_completion`` scores at completion only for DAPO's
    filter, a reward model or a batch reward function; an explicit value wins."""
    from postrl.trainer.asynchronous.feed import score_on_completion

    def resolved(*over: str) -> bool:
        return score_on_completion(load_config(None, [f"trainer.mode={mode}", *over]))

    assert resolved() is False
    assert resolved("algorithm.filter_groups.enable=true") is True
    assert resolved("reward.model.enable=true", "reward.model.path=/x") is True
    assert resolved("reward.custom_function.batch=true") is True
    assert resolved("trainer.async.score_on_completion=true") is True
    assert (
        resolved("algorithm.filter_groups.enable=true", "trainer.async.score_on_completion=false")
        is False
    )


def test_a_step_that_generates_itself_runs_while_the_next_batch_is_paused(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """ReMax rolls out a greedy baseline inside the step, after one_step_off paused the fleet
    with the next batch in flight: the context serves it and pauses again (no 600 s wait)."""
    ov = [
        *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
        "algorithm.adv_estimator=remax",
        "trainer.total_steps=2",
        "data.val_files=[]",
    ]
    trainer = RLTrainer(load_config(None, ov))
    try:
        last = trainer.fit()
    finally:
        trainer.close()
    assert last["remax/baseline_failed"] == 0 and last["replay/staleness/mean"] == 1.0


def test_off_policy_metrics_by_hand():
    """verl's training/off_policy/* from the per-token versions: staleness = current − oldest
    token's version, spans = versions that sampled the row (observation tokens, -1, skipped)."""
    from postrl.protocol import DataProto
    from postrl.trainer.asynchronous.stream import off_policy_metrics

    v = torch.tensor(
        [
            [3, 3, 3, -1],  # one version, 1 behind 4
            [2, 2, 3, 3],  # interrupted at version 2, resumed on 3
            [2, -1, -1, 3],  # a tool turn between its versions
            [-1, -1, -1, -1],  # nothing known: not counted
        ]
    )
    m = off_policy_metrics(DataProto.from_dict({"rollout_policy_version": v}), version=4)
    assert m["training/off_policy/trajectory_staleness/mean"] == pytest.approx(5 / 3)
    assert m["training/off_policy/trajectory_staleness/max"] == 2.0
    assert m["training/off_policy/trajectory_staleness/min"] == 1.0
    assert m["training/off_policy/trajectory_spans/mean"] == pytest.approx(5 / 3)
    assert (
        m["training/off_policy/trajectory_spans/max"],
        m["training/off_policy/trajectory_spans/min"],
    ) == (2.0, 1.0)


def test_decoupled_one_step_off_fuses_the_proximal_pass(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """One mini-batch, one epoch: π_prox is the update's own first forward (no separate
    old-log-prob pass), μ the rollout's; a batch one version old has π_prox/μ ≠ 1."""
    ov = [
        *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
        "actor.ppo_mini_batch_size=4",
        "trainer.total_steps=3",
        "data.val_files=[]",
        "rollout.verify_weights=false",  # (its probe scores a fixed sequence with the actor)
    ]
    trainer = RLTrainer(load_config(None, ov))
    calls = []
    pass_ = trainer.roles.actor.compute_log_prob
    trainer.roles.actor.compute_log_prob = lambda *a, **k: calls.append(1) or pass_(*a, **k)
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert calls == []
    rows = metric_rows(tmp_path / "run")
    assert all(r["actor/pg_clipfrac"] == 0.0 for r in rows)  # r = π/π_prox ≡ 1: one pass
    # step 2 trains groups generated before step 1's update (the second of the two batches
    # step 1 admitted), one version old: π_prox/μ ≠ 1 there
    off = [r for r in rows if r["replay/staleness/mean"] == 1.0]
    assert [int(r["step"]) for r in off][:1] == [2]
    assert all(r["actor/decoupled_kl_behav"] > 0 and r["health/ess_ratio"] < 1.0 for r in off)


def test_take_order_auto_is_the_modes_own(small_overrides):
    """``trainer.async.take_order=auto`` resolves to the order the mode registered
    (``one_step_off``: admission, verl's batches; ``fully_async``: completion), to completion
    when a sampler other than ``oldest_first`` is named (only that order consults it), and an
    explicit order wins."""
    from postrl.config.validate import take_order

    for mode, extra, want in (
        ("one_step_off", [], "admission"),
        ("fully_async", [], "completion"),
        ("one_step_off", ["trainer.sampler=my_pkg.samplers:Longest"], "completion"),
        ("one_step_off", ["trainer.async.take_order=completion"], "completion"),
        ("fully_async", ["trainer.async.take_order=admission"], "admission"),
    ):
        cfg = load_config(None, [*small_overrides, f"trainer.mode={mode}", *extra])
        assert take_order(cfg) == want, (mode, extra)


def test_groups_that_complete_together_are_scored_in_one_call(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """Without ``trainer.deterministic`` the groups that complete in one loop turn are scored by
    one ``runner.score_groups`` call (the batch's groups finish together); every generated group
    is scored once, and each trained row's score is what scoring its group alone gives."""
    cfg = load_config(
        None,
        [
            *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
            "trainer.total_steps=4",
            "trainer.test_freq=0",
            "trainer.async.score_on_completion=true",
        ],
    )
    trainer = RLTrainer(cfg)
    runner = trainer.ctx.runner
    calls: list[int] = []
    alone: dict[str, list[float]] = {}
    score_groups = runner.score_groups

    def spy(groups):
        calls.append(len(groups))
        for g in groups:  # the same group scored by itself
            ((_, scores, _),), _ = score_groups([g])
            alone[g[0].row["uid"]] = scores
        return score_groups(groups)

    runner.score_groups = spy
    trained: list[tuple[str, int, float]] = []

    def seen(batch):
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        nt = batch.non_tensor_batch
        trained.extend(zip(nt["uid"].tolist(), nt["sample_index"].tolist(), scores))

    _fit_seeing(trainer, seen)
    assert max(calls) > 1, calls  # a batch's groups were scored together
    assert sum(calls) == len(alone)  # no group scored twice
    assert len(trained) == 4 * 4 * 4  # 4 steps of 4 groups of 4
    for uid, k, score in trained:
        assert score == alone[uid][int(k)], (uid, k)


def test_groups_with_segment_rows_scored_together_keep_each_groups_rows(
    tiny_model_dir, epoch_files, digits_reward, tmp_path
):
    """Trajectories that bring ``segments`` (as a ``gateway`` agent that rewrote its history
    does) put their segment rows after all trajectories' own rows of a scoring call. Scoring
    several such groups in one call must still give each group exactly its own rows and its own
    segment rows, scored as when the group is scored alone (this lost the segment rows once,
    and only a gateway test that happened to complete two groups in one loop turn saw it)."""
    cfg = load_config(
        None,
        [
            *_base(tiny_model_dir, epoch_files, digits_reward, tmp_path / "run"),
            "trainer.total_steps=3",
            "trainer.test_freq=0",
            "trainer.async.score_on_completion=true",
        ],
    )
    trainer = RLTrainer(cfg)
    runner = trainer.ctx.runner
    run_agent = runner.agents.run

    async def with_a_segment(row, sampling):  # an earlier context: the response's first half
        out = await run_agent(row, sampling)
        k = max(len(out.response_ids) // 2, 1)
        seg = dataclasses.replace(
            out,
            response_ids=out.response_ids[:k],
            response_mask=out.response_mask[:k],
            response_logprobs=out.response_logprobs[:k],
            response_versions=None,
        )
        return dataclasses.replace(out, segments=[seg])

    runner.agents.run = with_a_segment
    score_groups = runner.score_groups
    calls: list[int] = []

    def rows_of(scored) -> list[tuple]:
        nt = scored.non_tensor_batch
        return sorted(
            zip(
                nt["uid"].tolist(),
                nt["sample_index"].tolist(),
                nt["segment"].tolist(),
                scored.batch["token_level_scores"].sum(-1).tolist(),
                scored.batch["response_mask"].sum(-1).tolist(),
                strict=True,
            )
        )

    def spy(groups):
        calls.append(len(groups))
        out, metrics = score_groups(groups)
        for g, (payloads, _, _) in zip(groups, out, strict=True):
            ((alone, _, _),), _ = score_groups([g])
            got, want = rows_of(payloads[0].scored), rows_of(alone[0].scored)
            assert got == want, (g[0].row["uid"], got, want)
            assert {r[2] for r in got} == {0, 1} and len(got) == 2 * len(g)
        return out, metrics

    runner.score_groups = spy
    segment_rows: list[int] = []
    _fit_seeing(
        trainer, lambda b: segment_rows.append(int((b.non_tensor_batch["segment"] > 0).sum()))
    )
    assert max(calls) > 1, calls  # some call scored several segmented groups
    assert segment_rows == [16, 16, 16]  # each step: 4 groups of 4, one segment row each
