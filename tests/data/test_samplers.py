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
