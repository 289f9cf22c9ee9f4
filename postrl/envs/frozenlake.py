"""FrozenLake on a tiny grid (deterministic, not slippery): walk from P to G, avoid the holes O.

Observation: the grid, one text row per grid row (``P`` you, ``G`` goal, ``O`` hole, ``.`` ice)::

    P..O
    .O..
    ....
    O..G

Rewards: 1.0 on reaching the goal (episode ends, success), 0.0 on falling into a hole (ends),
0.0 for any other move (moving into the border leaves you in place), ``invalid_reward`` for a
turn that names no action (the grid is shown again after "Invalid action."). The layout is drawn
from ``random.Random(seed)`` until the goal is reachable at least 2 moves away.
"""

from __future__ import annotations

import random

from postrl.envs.grid import ACTIONS, MOVES, bfs_actions, parse_action

__all__ = ["FrozenLake"]

Cell = tuple[int, int]


class FrozenLake:
    """FrozenLake with ``size`` x ``size`` cells and ``holes`` holes.

    Args:
        size: grid side (2-8).
        holes: number of holes (fewer than ``size * size - 2``).
        invalid_reward: reward of a turn that names no action (e.g. -0.1 to shape the format).
    """

    actions = ACTIONS
    instructions = "FrozenLake: move P to G, never onto O. Reply up, down, left or right."

    def __init__(self, size: int = 4, holes: int = 3, invalid_reward: float = 0.0) -> None:
        if not 2 <= int(size) <= 8:
            raise ValueError(f"frozenlake size={size!r}: must be in [2, 8]")
        if not 0 <= int(holes) < size * size - 2:
            raise ValueError(f"frozenlake holes={holes!r}: must be in [0, size*size - 2)")
        self.size, self.num_holes = int(size), int(holes)
        self.invalid_reward = float(invalid_reward)
        self.pos: Cell = (0, 0)
        self.goal: Cell = (0, 0)
        self.holes: frozenset[Cell] = frozenset()
        self.done = True
        self.success = False

    def reset(self, seed: int) -> str:
        """Draw the layout of ``seed``; return the grid."""
        rng = random.Random(int(seed))
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        for _ in range(10_000):
            start, goal, *holes = rng.sample(cells, 2 + self.num_holes)
            self.pos, self.goal, self.holes = start, goal, frozenset(holes)
            plan = self.solve()
            if plan is not None and len(plan) >= 2:
                break
        else:  # pragma: no cover - only for absurd hole counts
            raise ValueError(f"no solvable frozenlake layout for seed {seed}")
        self.done, self.success = False, False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool]:
        """Move once (see the module docstring for rewards)."""
        if self.done:
            raise RuntimeError("frozenlake: the episode is over; call reset(seed) first")
        word = parse_action(action)
        if word is None:
            return f"Invalid action.\n{self.render()}", self.invalid_reward, False
        self.pos = self._move(self.pos, word)
        if self.pos in self.holes:
            self.done = True
            return "You fell into a hole.", 0.0, True
        if self.pos == self.goal:
            self.done = self.success = True
            return "You reached the goal.", 1.0, True
        return self.render(), 0.0, False

    def solve(self) -> list[str] | None:
        """Shortest action list from the current cell to the goal (None: unreachable)."""

        def nxt(p: object, a: str) -> Cell | None:
            q = self._move(p, a)  # type: ignore[arg-type]
            return None if q in self.holes else q

        return bfs_actions(self.pos, nxt, lambda p: p == self.goal)

    def render(self) -> str:
        """The grid as text (see the module docstring)."""
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                cell = (r, c)
                row += (
                    "P"
                    if cell == self.pos
                    else "G"
                    if cell == self.goal
                    else "O"
                    if cell in self.holes
                    else "."
                )
            rows.append(row)
        return "\n".join(rows)

    def _move(self, p: Cell, word: str) -> Cell:
        dr, dc = MOVES[word]
        r, c = p[0] + dr, p[1] + dc
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else p
