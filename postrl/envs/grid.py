"""Shared pieces of the grid environments: moves, action parsing, breadth-first search."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Hashable

__all__ = ["ACTIONS", "MOVES", "bfs_actions", "parse_action"]

#: action word -> (row, column) offset.
MOVES: dict[str, tuple[int, int]] = {
    "up": (-1, 0),
    "down": (1, 0),
    "left": (0, -1),
    "right": (0, 1),
}
ACTIONS: tuple[str, ...] = tuple(MOVES)
_WORD = re.compile(r"\s*([A-Za-z]+)")


def parse_action(text: str) -> str | None:
    """The action a turn names: its first word, case-insensitive, if it is one of
    :data:`ACTIONS` (``"Right"``, ``" up."``); None otherwise (an invalid action)."""
    m = _WORD.match(text)
    word = m.group(1).lower() if m else ""
    return word if word in MOVES else None


def bfs_actions(
    start: Hashable,
    step: Callable[[Hashable, str], Hashable | None],
    goal: Callable[[Hashable], bool],
    limit: int = 100_000,
) -> list[str] | None:
    """Shortest action list from ``start`` to a state where ``goal`` holds (``[]`` when
    ``start`` is one), or None when none is reachable. ``step(state, action)`` returns the next
    state, or None for a move that ends the episode badly (e.g. a hole); ``limit`` bounds the
    states visited."""
    if goal(start):
        return []
    parent: dict[Hashable, tuple[Hashable, str] | None] = {start: None}
    queue = deque([start])
    while queue and len(parent) < limit:
        s = queue.popleft()
        for a in ACTIONS:
            t = step(s, a)
            if t is None or t in parent:
                continue
            parent[t] = (s, a)
            if goal(t):
                path = []
                cur: Hashable = t
                while parent[cur] is not None:
                    prev, act = parent[cur]  # type: ignore[misc]
                    path.append(act)
                    cur = prev
                return path[::-1]
            queue.append(t)
    return None
