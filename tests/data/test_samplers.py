"""Prompt samplers: sequential is the plain permutation; ``difficulty`` replays only prompts in
the learnable band, weighted toward p = 0.5, within its budget, and resumes exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from postrl.data import PromptLoader, RLDataset, generate_addition, load_tokenizer, write_parquet
from postrl.data.samplers import DifficultySampler, build_prompt_sampler


@pytest.fixture(scope="module")
def dataset(tiny_model_dir, tmp_path_factory):
    p = write_parquet(generate_addition(40, seed=0), tmp_path_factory.mktemp("d") / "a.parquet")
    return RLDataset([str(p)], load_tokenizer(tiny_model_dir))


def _indices(loader, steps):
    return [loader.next_batch().non_tensor_batch["index"].tolist() for _ in range(steps)]


def test_sequential_sampler_is_the_permutation(dataset):
    plain = PromptLoader(dataset, 4, seed=3)
    seq = PromptLoader(dataset, 4, seed=3, sampler=build_prompt_sampler("sequential", 40, 3))
    assert _indices(plain, 15) == _indices(seq, 15)
    assert seq.state_dict() == plain.state_dict()  # no sampler state in the checkpoint


def _observe(loader, idx):
    """Two responses per prompt: odd indices half right (p = 0.5), even ones all wrong."""
    rows = [i for i in idx for _ in range(2)]
    uids = [f"g{j // 2}" for j in range(len(rows))]
    scores = [float(i % 2 and j % 2 == 0) for j, i in enumerate(rows)]
    loader.observe(rows, uids, scores)


def test_difficulty_replays_only_band_prompts_and_keeps_fresh_order(dataset):
    sampler = DifficultySampler(40, seed=0, replay_fraction=0.5, max_replays=2)
    loader = PromptLoader(dataset, 4, seed=3, sampler=sampler)
    permutation = [i for b in _indices(PromptLoader(dataset, 4, seed=3), 10) for i in b]
    seen: set[int] = set()
    fresh, replayed = [], []
    for _ in range(12):
        idx = loader.next_batch().non_tensor_batch["index"].tolist()
        assert len(idx) == 4
        batch_replays = [i for i in idx if i in seen]
        assert len(batch_replays) <= 2  # floor(4 x replay_fraction)
        replayed += batch_replays
        fresh += [i for i in idx if i not in seen]
        seen.update(idx)
        _observe(loader, idx)
    assert fresh == permutation[: len(fresh)]  # fresh prompts keep the permutation's order
    assert replayed and all(i % 2 for i in replayed)  # only prompts with signal come back
    assert max(np.bincount(replayed)) <= 2  # max_replays
    m = sampler.metrics()
    assert m["sampler/replayed"] == len(replayed)
    assert m["sampler/observed_in_band"] == pytest.approx(
        sum(1 for i in fresh + replayed if i % 2) / len(fresh + replayed)
    )


def test_difficulty_prefers_p_near_one_half():
    sampler = DifficultySampler(3, seed=1, replay_fraction=0.5, max_replays=10_000)
    counts = np.zeros(3)
    for _ in range(2000):
        sampler.observe([0, 1, 2], [[1, 0], [1] * 9 + [0], [0, 0]])  # p = 0.5, 0.9, 0
        for i in sampler.replays(2)[:1]:
            counts[i] += 1
    assert counts[2] == 0  # p = 0: never
    # weights 0.25 vs 0.09 for the first of two draws without replacement: P(first = 0) = 0.735
    assert counts[0] / counts.sum() == pytest.approx(0.25 / 0.34, abs=0.04)


def test_difficulty_state_round_trips_through_json(dataset):
    def make():
        return PromptLoader(dataset, 4, seed=3, sampler=DifficultySampler(40, seed=5))

    full, part = make(), make()
    for loader in (full, part):
        for _ in range(6):
            _observe(loader, loader.next_batch().non_tensor_batch["index"].tolist())
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    for a, b in zip(_indices(full, 5), _indices(resumed, 5)):
        assert a == b


def test_bad_sampler_settings_are_named():
    with pytest.raises(ValueError, match="replay_fraction=1.5 must be in"):
        build_prompt_sampler("difficulty", 10, 0, {"replay_fraction": 1.5})
    with pytest.raises(ValueError, match="data.sampler='difficulty' with data.sampler_kwargs"):
        build_prompt_sampler("difficulty", 10, 0, {"replay": 0.5})
    with pytest.raises(ValueError, match="cannot import"):
        build_prompt_sampler("no_such_module_x:Cls", 10, 0)
    with pytest.raises(KeyError, match="did you mean 'difficulty'"):
        build_prompt_sampler("dificulty", 10, 0)
    with pytest.raises(ValueError, match="the dataset 12"):
        DifficultySampler(12).load_state_dict(DifficultySampler(10).state_dict())


def _fixed_greso(size=400, explore=0.5, **kw):
    from postrl.data.samplers import SelectiveRolloutSampler

    return SelectiveRolloutSampler(
        size, seed=1, explore=explore, explore_min=explore, explore_max=explore, **kw
    )


def test_greso_skips_uninformative_prompts_with_probability_one_minus_e_to_the_streak():
    """A prompt uninformative on its last z visits is skipped with probability 1 − e^z; one
    with signal on its last visit, or never seen, is never skipped."""
    s = _fixed_greso()
    s.observe(range(100), [[1.0, 1.0]] * 100)  # easy, z = 1
    s.observe(range(100, 200), [[0.0, 0.0]] * 100)  # hard, z = 1
    s.observe(range(200, 300), [[0.0, 0.0]] * 100)
    s.observe(range(200, 300), [[0.0, 0.0]] * 100)  # hard, z = 2
    s.observe(range(300, 350), [[0.0, 0.0]] * 50)
    s.observe(range(300, 350), [[0.0, 1.0]] * 50)  # signal on the last visit: streak over
    trials = 40
    rate = np.zeros(400)
    for _ in range(trials):
        rate += s.skip(range(400))
    rate /= trials
    # binomial: 4 000 draws per band, sd <= 0.008; the bands are 6 sd wide
    assert rate[:200].mean() == pytest.approx(0.5, abs=0.05)
    assert rate[200:300].mean() == pytest.approx(0.75, abs=0.05)
    assert rate[300:].max() == 0.0
    m = s.metrics()
    assert m["sampler/skipped"] == m["sampler/skipped_easy"] + m["sampler/skipped_hard"]
    assert m["sampler/skipped_easy"] == pytest.approx(0.5 * 100 * trials, rel=0.1)
    assert m["sampler/uninformative"] == pytest.approx(450 / 500)


def test_greso_adapts_each_kinds_exploration_to_its_target():
    """Too many hard groups uninformative: the hard kind explores less (down to its floor); no
    easy ones: the easy kind explores more (up to its ceiling)."""
    from postrl.data.samplers import SelectiveRolloutSampler

    s = SelectiveRolloutSampler(
        100, explore=0.5, explore_min=0.1, explore_max=0.9, explore_step=0.1, adapt_every=10
    )
    s.observe(range(30), [[0.0, 0.0]] * 30)  # three windows, all hard and uninformative
    assert s.metrics()["sampler/explore_hard"] == pytest.approx(0.2)
    assert s.metrics()["sampler/explore_easy"] == pytest.approx(0.8)
    s.observe(range(100), [[0.0, 0.0]] * 100)
    m = s.metrics()
    assert m["sampler/explore_hard"] == pytest.approx(0.1) and m["sampler/explore_easy"] == 0.9


def test_greso_loader_draws_k_fresh_prompts_and_accounts_for_every_skip(dataset):
    """Through the loader: every draw holds k prompts, none of them one the sampler skipped;
    over three epochs every prompt was drawn or skipped exactly once per epoch."""
    from postrl.data.samplers import SelectiveRolloutSampler

    sampler = SelectiveRolloutSampler(40, seed=2, explore=0.3, explore_min=0.3)
    loader = PromptLoader(dataset, 4, seed=3, sampler=sampler)
    draws, skipped = [], 0
    for _ in range(24):
        batch = loader.next_batch()
        idx = batch.non_tensor_batch["index"].tolist()
        assert len(idx) == 4
        draws.append((idx, batch.meta_info["epochs"]))
        _observe(loader, idx)  # odd rows have signal, even ones are all wrong
        skipped += sampler.metrics()["sampler/skipped"]
    assert skipped > 0
    drawn = [(i, e) for idx, eps in draws for i, e in zip(idx, eps)]
    assert sorted(i for i, e in drawn if e == 0) == list(range(40))  # nothing seen: no skip
    for epoch in (1, 2):
        got = [i for i, e in drawn if e == epoch]
        assert len(got) == len(set(got))  # at most once per epoch
        assert set(i for i in range(1, 40, 2)) <= set(got)  # signal rows: never skipped
    walked = 40 * loader.epoch + loader.position
    assert walked == len(drawn) + skipped  # every walked prompt was drawn or counted skipped


def test_greso_state_resumes_the_same_skips(dataset):
    """A loader restored from the state of step 5 draws what the uninterrupted one draws."""
    from postrl.data.samplers import SelectiveRolloutSampler

    def make():
        return PromptLoader(dataset, 4, seed=3, sampler=SelectiveRolloutSampler(40, seed=2))

    full, part = make(), make()
    for loader in (full, part):
        for _ in range(12):
            _observe(loader, loader.next_batch().non_tensor_batch["index"].tolist())
    state = json.loads(json.dumps(part.state_dict()))
    assert state["sampler"]["streak"], "nothing uninformative observed"
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(8):
        a, b = full.next_batch(), resumed.next_batch()
        assert a.non_tensor_batch["index"].tolist() == b.non_tensor_batch["index"].tolist()
        _observe(full, a.non_tensor_batch["index"].tolist())
        _observe(resumed, b.non_tensor_batch["index"].tolist())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"explore_min": 0.0}, "explore_min=0.0"),
        ({"explore": 0.01}, "explore=0.01"),
        ({"target_hard": 2.0}, "target_hard=2.0"),
        ({"adapt_every": 0}, "adapt_every=0"),
    ],
)
def test_greso_bad_kwargs_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match="data.sampler_kwargs of 'greso'") as e:
        build_prompt_sampler("greso", 10, 0, kwargs)
    assert needle in str(e.value)
