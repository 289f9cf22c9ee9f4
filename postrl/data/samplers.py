"""Prompt samplers: which prompts the loader hands out next, learned from the groups' rewards.

The :class:`~postrl.data.dataset.PromptLoader` walks a seeded permutation of the training set,
each prompt once per epoch. A prompt sampler (``data.sampler``) may add *replays* to a batch:
prompts seen before, chosen from what their groups scored. Fresh prompts keep the permutation's
order and its once-per-epoch guarantee; replays come on top of it and are counted
(``sampler/replayed``), never hidden.

Registered samplers (``PROMPT_SAMPLERS``):

* ``sequential`` (default): no replays — exactly the permutation.
* ``difficulty``: online difficulty-aware replay. Each prompt keeps an exponential moving average
  of its groups' success rate ``p`` (the share of responses scoring at least
  ``success_threshold``). Prompts in the learnable band ``low < p < high`` — the ones whose groups
  have reward variance, so a group-relative advantage is non-zero — form a pool; up to
  ``replay_fraction`` of every batch is drawn from it, weighted by ``p (1 − p)`` (the Bernoulli
  variance: the expected signal of a group), each prompt at most ``max_replays`` times. Solved
  (``p = 1``) and hopeless (``p = 0``) prompts leave the pool. This is the online difficulty
  filtering of PRIME (Cui et al. 2025, arXiv 2502.01456) and Polaris-style curricula, done as
  replay of measured prompts instead of an offline pass.
* ``greso``: selective rollout — fresh prompts that were *uninformative* on their most recent
  visits are skipped before they are generated. A group is uninformative when all its responses
  score the same (its group-relative advantages are all zero): *easy* when that score is a
  success, *hard* otherwise. A prompt whose last ``z`` visits were uninformative is skipped with
  probability ``1 − e^z``, ``e`` the exploration probability of its kind; ``e`` moves by
  ``explore_step`` after every ``adapt_every`` observed groups, down when that kind's share of
  them is above its target (``target_easy``, ``target_hard``), up when below, within
  ``[explore_min, explore_max]``. After GRESO (Zheng et al. 2025, "Act Only When It Pays",
  arXiv 2506.02177): prompt value is consistent from one visit to the next, so the rollouts
  DAPO's dynamic sampling would generate and throw away are mostly not generated at all.
  Skipped prompts are counted (``sampler/skipped``, by kind), not trained in that epoch, and
  visited again in the next one.

The loader asks a sampler with a ``skip(indices) -> list[bool]`` method (optional in the
protocol) which fresh prompts to pass over. With ``algorithm.filter_groups`` the groups it
filters out are reported to the sampler too (``observe``), as the trained ones are.

A custom sampler: a class with ``replays(k) -> list[int]``, ``observe(indices, scores)``,
``metrics()``, ``state_dict()`` and ``load_state_dict(state)``, constructed as
``cls(size, seed, **data.sampler_kwargs)``; register it with ``@PROMPT_SAMPLERS.register(name)``
or give ``data.sampler=module:Class``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from postrl.registry import Registry

__all__ = [
    "PROMPT_SAMPLERS",
    "PromptSampler",
    "SequentialSampler",
    "DifficultySampler",
    "SelectiveRolloutSampler",
    "build_prompt_sampler",
]

PROMPT_SAMPLERS: Registry[type] = Registry("prompt sampler")


class PromptSampler(Protocol):
    """Adds replays of seen prompts to the loader's batches and learns from their rewards."""

    def replays(self, k: int) -> list[int]:
        """At most ``k`` dataset indices to hand out again in the next batch."""
        ...

    def observe(self, indices: Sequence[int], scores: Sequence[Sequence[float]]) -> None:
        """Per scored group: its prompt's dataset index and its responses' scores."""
        ...

    def metrics(self) -> dict[str, float]:
        """``sampler/*`` metrics since the last call."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (checkpoints)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


@PROMPT_SAMPLERS.register("sequential")
class SequentialSampler:
    """No replays: the loader's permutation, each prompt once per epoch."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size

    def replays(self, k: int) -> list[int]:
        """None."""
        return []

    def observe(self, indices: Sequence[int], scores: Sequence[Sequence[float]]) -> None:
        """Ignored."""

    def metrics(self) -> dict[str, float]:
        """None."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateless."""


@PROMPT_SAMPLERS.register("difficulty")
class DifficultySampler:
    """Replays prompts in the learnable band, weighted by ``p (1 − p)`` (module docstring).

    Args:
        size: prompts in the dataset.
        seed: seed of the replay draws.
        replay_fraction: most of a batch that may be replays, in [0, 1).
        low, high: the band, exclusive: ``low < p < high``.
        ema: weight of the newest observation in the moving average, in (0, 1].
        max_replays: times one prompt may be replayed in the run.
        success_threshold: a response with at least this score is a success.
    """

    def __init__(
        self,
        size: int,
        seed: int = 0,
        *,
        replay_fraction: float = 0.5,
        low: float = 0.0,
        high: float = 1.0,
        ema: float = 1.0,
        max_replays: int = 4,
        success_threshold: float = 1.0,
    ) -> None:
        errors = []
        if not 0.0 <= replay_fraction < 1.0:
            errors.append(f"replay_fraction={replay_fraction} must be in [0, 1)")
        if not 0.0 <= low < high <= 1.0:
            errors.append(f"low={low}, high={high}: need 0 <= low < high <= 1")
        if not 0.0 < ema <= 1.0:
            errors.append(f"ema={ema} must be in (0, 1]")
        if max_replays < 1:
            errors.append(f"max_replays={max_replays} must be >= 1")
        if errors:
            raise ValueError("data.sampler_kwargs of 'difficulty': " + "; ".join(errors))
        self.size, self.seed = size, seed
        self.replay_fraction, self.low, self.high = replay_fraction, low, high
        self.ema, self.max_replays = ema, max_replays
        self.success_threshold = success_threshold
        self.p = np.full(size, np.nan)  # moving success rate; NaN = never observed
        self.replayed = np.zeros(size, dtype=np.int64)
        self.pool: set[int] = set()  # in band, replays left, not handed out since last seen
        self.draws = 0
        self._m = dict.fromkeys(("replayed", "observed", "observed_in_band"), 0)

    def replays(self, k: int) -> list[int]:
        """Up to ``floor(k × replay_fraction)`` pool prompts, without replacement, weighted by
        ``p (1 − p)``; each leaves the pool until its group is observed again."""
        want = min(int(k * self.replay_fraction), len(self.pool))
        self.draws += 1
        if want <= 0:
            return []
        cand = np.fromiter(sorted(self.pool), dtype=np.int64)
        w = self.p[cand] * (1.0 - self.p[cand])
        rng = np.random.default_rng([self.seed, self.draws])
        chosen = rng.choice(cand, size=want, replace=False, p=w / w.sum())
        for i in chosen.tolist():
            self.pool.discard(i)
            self.replayed[i] += 1
        self._m["replayed"] += want
        return chosen.tolist()

    def observe(self, indices: Sequence[int], scores: Sequence[Sequence[float]]) -> None:
        """Update each prompt's moving success rate (the share of its group's responses scoring
        at least ``success_threshold``); (re-)admit it to the pool when it is in the band and
        has replays left, drop it otherwise."""
        for i, group in zip(indices, scores):
            i = int(i)
            s = float(np.mean(np.asarray(group, dtype=np.float64) >= self.success_threshold))
            old = self.p[i]
            p = float(s) if np.isnan(old) else (1 - self.ema) * old + self.ema * float(s)
            self.p[i] = p
            self._m["observed"] += 1
            if self.low < p < self.high:
                self._m["observed_in_band"] += 1
                if self.replayed[i] < self.max_replays:
                    self.pool.add(i)
                    continue
            self.pool.discard(i)

    def metrics(self) -> dict[str, float]:
        """``sampler/replayed`` (prompts replayed since the last call), ``sampler/pool_size``,
        ``sampler/observed_in_band`` (share of observed groups with signal), ``sampler/seen``
        (share of the dataset observed at least once) and ``sampler/pool_mean_p``."""
        m, self._m = self._m, dict.fromkeys(self._m, 0)
        pool = np.fromiter(self.pool, dtype=np.int64)
        return {
            "sampler/replayed": float(m["replayed"]),
            "sampler/pool_size": float(len(pool)),
            "sampler/observed_in_band": m["observed_in_band"] / max(m["observed"], 1),
            "sampler/seen": float(np.mean(~np.isnan(self.p))),
            "sampler/pool_mean_p": float(self.p[pool].mean()) if len(pool) else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        """The moving rates (NaN as None), replay counts, pool and draw counter."""
        return {
            "p": [None if np.isnan(x) else float(x) for x in self.p],
            "replayed": self.replayed.tolist(),
            "pool": sorted(self.pool),
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same dataset size)."""
        if len(state["p"]) != self.size:
            raise ValueError(
                f"difficulty sampler state holds {len(state['p'])} prompts, the dataset "
                f"{self.size}: resume with the same data.train_files"
            )
        self.p = np.array([np.nan if x is None else x for x in state["p"]], dtype=np.float64)
        self.replayed = np.asarray(state["replayed"], dtype=np.int64)
        self.pool = {int(i) for i in state["pool"]}
        self.draws = int(state["draws"])


@PROMPT_SAMPLERS.register("greso")
class SelectiveRolloutSampler:
    """Skips fresh prompts that were uninformative on their recent visits (module docstring).

    Args:
        size: prompts in the dataset.
        seed: seed of the skip draws.
        explore: starting exploration probability of both kinds, in
            ``[explore_min, explore_max]``.
        explore_min, explore_max: its bounds, ``0 < explore_min <= explore_max <= 1``.
        explore_step: how far one adaptation moves it.
        target_easy, target_hard: the share of observed groups that may be uninformative of
            each kind before its exploration probability goes down.
        adapt_every: observed groups between two adaptations.
        success_threshold: an uninformative group whose score is at least this is *easy*.
    """

    EASY, HARD = 1, 2

    def __init__(
        self,
        size: int,
        seed: int = 0,
        *,
        explore: float = 0.5,
        explore_min: float = 0.05,
        explore_max: float = 1.0,
        explore_step: float = 0.01,
        target_easy: float = 0.125,
        target_hard: float = 0.125,
        adapt_every: int = 64,
        success_threshold: float = 1.0,
    ) -> None:
        errors = []
        if not 0.0 < explore_min <= explore_max <= 1.0:
            errors.append(
                f"explore_min={explore_min}, explore_max={explore_max}: need "
                "0 < explore_min <= explore_max <= 1 (explore_min 0 would skip a prompt forever)"
            )
        elif not explore_min <= explore <= explore_max:
            errors.append(f"explore={explore} must be in [explore_min, explore_max]")
        if not 0.0 <= explore_step <= 1.0:
            errors.append(f"explore_step={explore_step} must be in [0, 1]")
        for name, v in (("target_easy", target_easy), ("target_hard", target_hard)):
            if not 0.0 <= v <= 1.0:
                errors.append(f"{name}={v} must be in [0, 1]")
        if adapt_every < 1:
            errors.append(f"adapt_every={adapt_every} must be >= 1")
        if errors:
            raise ValueError("data.sampler_kwargs of 'greso': " + "; ".join(errors))
        self.size, self.seed = size, seed
        self.explore_min, self.explore_max = explore_min, explore_max
        self.explore_step = explore_step
        self.targets = {self.EASY: target_easy, self.HARD: target_hard}
        self.adapt_every, self.success_threshold = adapt_every, success_threshold
        self.explore = {self.EASY: explore, self.HARD: explore}
        self.streak = np.zeros(size, dtype=np.int64)  # uninformative visits in a row, latest
        self.kind = np.zeros(size, dtype=np.int8)  # of the latest visit: 0, EASY or HARD
        self.draws = 0
        self._window = dict.fromkeys((0, self.EASY, self.HARD), 0)  # observed since adapting
        self._m = dict.fromkeys(("skipped_easy", "skipped_hard", "observed", "uninformative"), 0)

    def replays(self, k: int) -> list[int]:
        """None: this sampler only skips."""
        return []

    def skip(self, indices: Sequence[int]) -> list[bool]:
        """Per fresh prompt: skip it before rollout (True) with probability ``1 − e^z``."""
        idx = np.asarray(indices, dtype=np.int64)
        self.draws += 1
        z = self.streak[idx]
        kind = self.kind[idx]
        e = np.where(kind == self.EASY, self.explore[self.EASY], self.explore[self.HARD])
        p = np.where(z > 0, 1.0 - np.power(e, z), 0.0)
        u = np.random.default_rng([self.seed, 1, self.draws]).random(len(idx))
        out = u < p
        self._m["skipped_easy"] += int((out & (kind == self.EASY)).sum())
        self._m["skipped_hard"] += int((out & (kind == self.HARD)).sum())
        return out.tolist()

    def observe(self, indices: Sequence[int], scores: Sequence[Sequence[float]]) -> None:
        """Per scored group: lengthen its prompt's uninformative streak (all scores equal) or
        end it; every ``adapt_every`` groups, move each kind's exploration probability."""
        for i, group in zip(indices, scores):
            i = int(i)
            g = np.asarray(group, dtype=np.float64)
            flat = len(g) > 0 and float(g.max() - g.min()) <= 1e-9
            kind = (self.EASY if g[0] >= self.success_threshold else self.HARD) if flat else 0
            self.streak[i] = self.streak[i] + 1 if flat else 0
            self.kind[i] = kind
            self._window[kind] += 1
            self._m["observed"] += 1
            self._m["uninformative"] += int(flat)
            if sum(self._window.values()) >= self.adapt_every:
                self._adapt()

    def _adapt(self) -> None:
        n = sum(self._window.values())
        for kind, target in self.targets.items():
            step = -self.explore_step if self._window[kind] / n > target else self.explore_step
            e = self.explore[kind] + step
            self.explore[kind] = min(max(e, self.explore_min), self.explore_max)
        self._window = dict.fromkeys(self._window, 0)

    def metrics(self) -> dict[str, float]:
        """``sampler/skipped`` (fresh prompts skipped before rollout since the last call;
        ``sampler/skipped_easy``, ``sampler/skipped_hard`` by kind), ``sampler/uninformative``
        (share of the groups observed since the last call whose scores were all equal),
        ``sampler/explore_easy`` and ``sampler/explore_hard`` (the exploration probabilities)."""
        m, self._m = self._m, dict.fromkeys(self._m, 0)
        return {
            "sampler/skipped": float(m["skipped_easy"] + m["skipped_hard"]),
            "sampler/skipped_easy": float(m["skipped_easy"]),
            "sampler/skipped_hard": float(m["skipped_hard"]),
            "sampler/uninformative": m["uninformative"] / max(m["observed"], 1),
            "sampler/explore_easy": self.explore[self.EASY],
            "sampler/explore_hard": self.explore[self.HARD],
        }

    def state_dict(self) -> dict[str, Any]:
        """Streaks and kinds (as sparse lists), exploration probabilities, the adaptation
        window and the draw counter."""
        seen = np.flatnonzero(self.streak).tolist()
        return {
            "size": self.size,
            "streak": [[i, int(self.streak[i]), int(self.kind[i])] for i in seen],
            "explore": [self.explore[self.EASY], self.explore[self.HARD]],
            "window": [self._window[0], self._window[self.EASY], self._window[self.HARD]],
            "draws": self.draws,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same dataset size)."""
        if int(state["size"]) != self.size:
            raise ValueError(
                f"greso sampler state holds {state['size']} prompts, the dataset {self.size}: "
                "resume with the same data.train_files"
            )
        self.streak[:] = 0
        self.kind[:] = 0
        for i, z, kind in state["streak"]:
            self.streak[int(i)], self.kind[int(i)] = int(z), int(kind)
        easy, hard = (float(x) for x in state["explore"])
        self.explore = {self.EASY: easy, self.HARD: hard}
        w = [int(x) for x in state["window"]]
        self._window = {0: w[0], self.EASY: w[1], self.HARD: w[2]}
        self.draws = int(state["draws"])


def build_prompt_sampler(
    name: str, size: int, seed: int, kwargs: dict[str, Any] | None = None
) -> PromptSampler:
    """A sampler from a registered name or a ``module:Class`` path, as
    ``cls(size, seed, **kwargs)``; a bad name or keyword raises naming ``data.sampler``."""
    cls = PROMPT_SAMPLERS.get_or_import(name, "data.sampler")
    try:
        return cls(size, seed, **(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"data.sampler={name!r} with data.sampler_kwargs={kwargs}: {e}") from e
