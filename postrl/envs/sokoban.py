"""Sokoban on a tiny room with one box: push the box B onto the target T.

Observation: the room with its border walls, one text row per grid row (``#`` wall, ``.`` floor,
``T`` target, ``B`` box, ``P`` you, ``+`` you standing on the target)::

    ######
    #.T..#
    #..#.#
    #.B..#
    #..P.#
    ######

Moving into the box pushes it when the cell behind it is free; a move into a wall or an
unpushable box leaves everything in place. Rewards: ``step_reward`` (-0.1) for every turn
(invalid ones included) plus ``solve_reward`` (1.0) on the turn that puts the box on the target,
which ends the episode (success). A box pushed into a dead position is not ended early: the
turn budget runs out (as in RAGEN). The layout (``walls`` interior walls, the target, the box
and you) is drawn from ``random.Random(seed)`` until the shortest solution takes 1 to
``max_solution`` moves.
"""

from __future__ import annotations

import random

from postrl.envs.grid import ACTIONS, MOVES, bfs_actions, parse_action

__all__ = ["Sokoban"]

Cell = tuple[int, int]
State = tuple[Cell, Cell]  # (player, box)


class Sokoban:
    """One-box Sokoban in a ``size`` x ``size`` room (plus border walls).

    Args:
        size: interior side (3-6).
        walls: interior wall cells.
        max_solution: longest shortest-solution (in moves) a drawn layout may have.
        step_reward: reward of every turn.
        solve_reward: added on the turn that solves the puzzle.
    """

    actions = ACTIONS
    instructions = (
        "Sokoban: push box B onto target T. P is you, # is a wall. Reply up, down, left or right."
    )

    def __init__(
        self,
        size: int = 4,
        walls: int = 1,
        max_solution: int = 6,
        step_reward: float = -0.1,
        solve_reward: float = 1.0,
    ) -> None:
        if not 3 <= int(size) <= 6:
            raise ValueError(f"sokoban size={size!r}: must be in [3, 6]")
        if not 0 <= int(walls) <= size * size - 4:
            raise ValueError(f"sokoban walls={walls!r}: must be in [0, size*size - 4]")
        if int(max_solution) < 1:
            raise ValueError(f"sokoban max_solution={max_solution!r}: must be >= 1")
        self.size, self.num_walls, self.max_solution = int(size), int(walls), int(max_solution)
        self.step_reward, self.solve_reward = float(step_reward), float(solve_reward)
        self.walls: frozenset[Cell] = frozenset()
        self.target: Cell = (0, 0)
        self.state: State = ((0, 0), (0, 0))
        self.done = True
        self.success = False

    def reset(self, seed: int) -> str:
        """Draw the layout of ``seed``; return the room."""
        rng = random.Random(int(seed))
        n = self.size
        inner = [(r, c) for r in range(1, n + 1) for c in range(1, n + 1)]
        border = {(r, c) for r in range(n + 2) for c in range(n + 2)} - set(inner)
        for _ in range(10_000):
            target, box, player, *walls = rng.sample(inner, 3 + self.num_walls)
            self.walls, self.target = frozenset(border | set(walls)), target
            self.state = (player, box)
            plan = self.solve()
            if plan and len(plan) <= self.max_solution:
                break
        else:  # pragma: no cover - only for absurd settings
            raise ValueError(f"no solvable sokoban layout for seed {seed}")
        self.done, self.success = False, False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool]:
        """Move (and maybe push) once (see the module docstring for rewards)."""
        if self.done:
            raise RuntimeError("sokoban: the episode is over; call reset(seed) first")
        word = parse_action(action)
        if word is None:
            return f"Invalid action.\n{self.render()}", self.step_reward, False
        self.state = self._move(self.state, word)
        if self.state[1] == self.target:
            self.done = self.success = True
            return "The box is on the target.", self.step_reward + self.solve_reward, True
        return self.render(), self.step_reward, False

    def solve(self) -> list[str] | None:
        """Shortest action list that puts the box on the target (None: impossible now)."""
        return bfs_actions(
            self.state,
            lambda s, a: self._move(s, a),  # type: ignore[arg-type]
            lambda s: s[1] == self.target,  # type: ignore[index]
        )

    def render(self) -> str:
        """The room as text (see the module docstring)."""
        player, box = self.state
        rows = []
        for r in range(self.size + 2):
            row = ""
            for c in range(self.size + 2):
                cell = (r, c)
                if cell in self.walls:
                    row += "#"
                elif cell == player:
                    row += "+" if cell == self.target else "P"
                elif cell == box:
                    row += "B"
                else:
                    row += "T" if cell == self.target else "."
            rows.append(row)
        return "\n".join(rows)

    def _move(self, state: State, word: str) -> State:
        (pr, pc), box = state
        dr, dc = MOVES[word]
        nxt = (pr + dr, pc + dc)
        if nxt in self.walls:
            return state
        if nxt == box:
            behind = (box[0] + dr, box[1] + dc)
            if behind in self.walls:
                return state
            return (nxt, behind)
        return (nxt, box)
