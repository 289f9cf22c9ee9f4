"""Samplers: which complete groups the next update trains on, decided from tags only.

A sampler is a class with ``select(groups, k, current_version) -> list[str]``: from the
candidate :class:`~postrl.trainer.asynchronous.replay.tags.GroupTags` (complete, within the
staleness bound) it returns ``k`` distinct group uids. It sees tags, never payloads — the buffer has
nothing else to give it.

Registered samplers (``trainer.sampler``):

* ``oldest_first`` (default): by the oldest policy version among the group's tokens, then
  dispatch step, then admission order — earliest-deadline-first for the staleness bound.

A custom sampler needs no registration: ``build_sampler("my_pkg.samplers:LongestFirst")``
imports the class by path (``module:Class``) and instantiates it with no arguments. Or register
it: ``@SAMPLERS.register("longest_first")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from postrl.registry import Registry
from postrl.trainer.asynchronous.replay.tags import GroupTags, sort_oldest_first

__all__ = ["SAMPLERS", "Sampler", "OldestFirstSampler", "build_sampler", "check_selection"]

SAMPLERS: Registry[type] = Registry("replay sampler")


class Sampler(Protocol):
    """Chooses the groups of the next update from their tags."""

    def select(self, groups: Sequence[GroupTags], k: int, current_version: int) -> list[str]:
        """``k`` distinct uids among ``groups`` (``len(groups) >= k`` is guaranteed)."""
        ...


@SAMPLERS.register("oldest_first")
class OldestFirstSampler:
    """Oldest tokens first (ties: dispatch step, then admission order)."""

    def select(self, groups: Sequence[GroupTags], k: int, current_version: int) -> list[str]:
        """The ``k`` groups with the oldest policy versions."""
        return [g.uid for g in sort_oldest_first(groups)[:k]]


def build_sampler(name: str) -> Sampler:
    """A sampler instance from a registered name or a ``module:Class`` import path."""
    cls = SAMPLERS.get_or_import(name, "trainer.sampler")
    sampler = cls()
    if not callable(getattr(sampler, "select", None)):
        raise TypeError(
            f"trainer.sampler={name!r}: {cls!r} has no select(groups, k, current_version) method"
        )
    return sampler


def check_selection(name: str, chosen: Sequence[str], groups: Sequence[GroupTags], k: int) -> None:
    """Raise naming the sampler when ``chosen`` is not ``k`` distinct uids of ``groups``."""
    uids = {g.uid for g in groups}
    bad = [u for u in chosen if u not in uids]
    if len(chosen) != k or len(set(chosen)) != k or bad:
        raise ValueError(
            f"sampler {name!r} returned {len(chosen)} uids ({len(set(chosen))} distinct, "
            f"{len(bad)} not among the {len(groups)} candidates, e.g. {bad[:3]}); it must "
            f"return exactly {k} distinct uids of the groups it was given"
        )
