"""Environment dynamics, derived by hand, and the dataset rows / demonstrations built on them."""

from __future__ import annotations

import pytest

from postrl.envs import (
    ENVS,
    Env,
    discounted_return,
    env_demonstrations,
    env_rows,
    make_env,
    register_env,
)
from postrl.envs.grid import parse_action
from postrl.registry import RegistryError


def _lake(pos, goal, holes, size=3):
    env = make_env("frozenlake", size=size, holes=len(holes), invalid_reward=-0.5)
    env.reset(0)
    env.pos, env.goal, env.holes = pos, goal, frozenset(holes)
    return env


def test_frozenlake_moves_walls_holes_and_goal():
    # P . .      start (0,0), hole (1,1), goal (2,2) on a 3x3 grid
    # . O .
    # . . G
    env = _lake((0, 0), (2, 2), [(1, 1)])
    assert env.render() == "P..\n.O.\n..G"
    assert env.step("up") == ("P..\n.O.\n..G", 0.0, False)  # the border: stays put
    assert env.step("Right.") == (".P.\n.O.\n..G", 0.0, False)  # first word, any case
    assert env.step("jump") == ("Invalid action.\n.P.\n.O.\n..G", -0.5, False)
    assert env.solve() == ["right", "down", "down"]  # down would fall into the hole
    assert env.step("down") == ("You fell into a hole.", 0.0, True)
    assert env.done and not env.success
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("up")
    env = _lake((0, 0), (2, 2), [(1, 1)])
    rewards = [env.step(a)[1] for a in ["down", "down", "right", "right"]]
    assert rewards == [0.0, 0.0, 0.0, 1.0] and env.success and env.done


def test_frozenlake_layouts_are_deterministic_and_solvable():
    a, b = make_env("frozenlake"), make_env("frozenlake")
    assert a.reset(5) == b.reset(5)
    layouts = {a.reset(s) for s in range(40)}
    assert len(layouts) > 30  # seeds give different layouts
    for s in range(40):
        a.reset(s)
        plan = a.solve()
        assert plan is not None and len(plan) >= 2
        for act in plan:
            _, r, done = a.step(act)
        assert done and r == 1.0 and a.success


def _sokoban():
    # ######     walls: the border and (2,3); target (1,2), box (3,2), player (4,2)
    # #.T..#
    # #..#.#
    # #.B..#
    # #.P..#
    # ######
    env = make_env("sokoban", size=4, walls=1)
    env.reset(0)
    border = {(r, c) for r in range(6) for c in range(6)} - {
        (r, c) for r in range(1, 5) for c in range(1, 5)
    }
    env.walls, env.target, env.state = frozenset(border | {(2, 3)}), (1, 2), ((4, 2), (3, 2))
    return env


def test_sokoban_push_block_and_rewards():
    env = _sokoban()
    assert env.render() == "######\n#.T..#\n#..#.#\n#.B..#\n#.P..#\n######"
    assert env.solve() == ["up", "up"]
    assert env.step("down") == (env.render(), -0.1, False)  # wall below: nothing moves
    assert env.state == ((4, 2), (3, 2))
    obs, r, done = env.step("up")  # pushes the box to (2,2)
    assert obs == "######\n#.T..#\n#.B#.#\n#.P..#\n#....#\n######" and r == -0.1 and not done
    obs, r, done = env.step("up")  # box onto the target: -0.1 + 1.0
    assert (obs, done, env.success) == ("The box is on the target.", True, True)
    assert r == pytest.approx(0.9)
    env = _sokoban()
    env.state = ((2, 4), (2, 2))  # the player east of the inner wall (2,3)
    assert env.step("left") == (env.render(), -0.1, False)  # (2,3) is a wall: blocked
    env.state = ((3, 2), (2, 2))  # player below the box, box below the target
    assert env.step("up")[1:] == pytest.approx((0.9, True))


def test_sokoban_layouts_deterministic_and_within_the_solution_bound():
    a, b = make_env("sokoban", max_solution=5), make_env("sokoban", max_solution=5)
    for s in range(15):
        assert a.reset(s) == b.reset(s)
        plan = a.solve()
        assert plan and len(plan) <= 5
        rewards = [a.step(act)[1] for act in plan]
        # every turn costs 0.1, the solving one also earns 1.0
        assert sum(rewards) == pytest.approx(1.0 - 0.1 * len(plan))
        assert a.success


def test_discounted_return_by_hand():
    assert discounted_return([], 0.9) == 0.0
    assert discounted_return([-0.1, -0.1, 0.9], 1.0) == pytest.approx(0.7)
    # -0.1 + 0.5 * -0.1 + 0.25 * 0.9 = -0.1 - 0.05 + 0.225
    assert discounted_return([-0.1, -0.1, 0.9], 0.5) == pytest.approx(0.075)


def test_parse_action():
    assert parse_action("Left") == "left"
    assert parse_action("  down, then up") == "down"
    assert parse_action("go up") is None and parse_action("") is None


def test_env_rows_layout_and_disjoint_splits():
    train = env_rows("frozenlake", 20, seed=3)
    test = env_rows("frozenlake", 20, seed=3, split="test")
    seeds = {r["extra_info"]["seed"] for r in train}
    assert len(seeds) == 20 and not seeds & {r["extra_info"]["seed"] for r in test}
    row = train[0]
    assert row["data_source"] == "env/frozenlake" and row["agent_name"] == "env_agent"
    env = make_env("frozenlake")
    assert row["prompt"][-1]["content"].endswith("\n" + env.reset(row["extra_info"]["seed"]))
    assert env_rows("frozenlake", 20, seed=3) == train  # deterministic
    kw = env_rows("sokoban", 2, env_kwargs={"size": 3, "walls": 0})
    assert kw[0]["extra_info"]["env_kwargs"] == {"size": 3, "walls": 0}


def test_expert_demonstrations_solve_and_noise_perturbs():
    clean = env_demonstrations("sokoban", 10, seed=1, noise=0.0)
    for row in clean:
        msgs = row["messages"]
        assert [m["role"] for m in msgs][:2] == ["user", "assistant"]
        assert msgs[-1]["role"] == "assistant"
    env = make_env("sokoban")
    seed_rows = env_demonstrations("frozenlake", 30, seed=2, noise=0.0, max_turns=8)
    noisy = env_demonstrations("frozenlake", 30, seed=2, noise=1.0, max_turns=8)
    assert all(r["messages"][-1]["content"] in env.actions for r in seed_rows)
    assert seed_rows != noisy
    with pytest.raises(ValueError, match="noise"):
        env_demonstrations("frozenlake", 1, noise=1.5)


def test_registry_errors_and_custom_env():
    with pytest.raises(RegistryError, match="frozenlake"):
        make_env("frozenlak")

    class NoStep:
        def reset(self, seed):
            return "x"

    ENVS.add("test_nostep", NoStep, override=True)
    with pytest.raises(TypeError, match="step"):
        make_env("test_nostep")

    @register_env("test_counter")
    class Counter:
        def reset(self, seed: int) -> str:
            self.n = seed
            return str(self.n)

        def step(self, action: str) -> tuple[str, float, bool]:
            self.n += 1
            return str(self.n), 1.0, self.n >= 3

    env = make_env("test_counter")
    assert isinstance(env, Env) and env.reset(1) == "1"
    assert env.step("a") == ("2", 1.0, False) and env.step("a") == ("3", 1.0, True)


class Countdown:
    """An unregistered environment, named by its import path."""

    def __init__(self, start: int = 2) -> None:
        self.start = start

    def reset(self, seed: int) -> str:
        self.n = self.start + seed
        return str(self.n)

    def step(self, action: str) -> tuple[str, float, bool]:
        self.n -= 1
        return str(self.n), -1.0, self.n <= 0


def test_an_unregistered_env_by_import_path():
    env = make_env("test_envs:Countdown", start=1)
    assert env.reset(1) == "2" and env.step("x") == ("1", -1.0, False)
    rows = env_rows("test_envs:Countdown", 2, env_kwargs={"start": 5})
    assert rows[0]["extra_info"]["env"] == "test_envs:Countdown"
    assert rows[0]["prompt"][-1]["content"] == str(5 + rows[0]["extra_info"]["seed"])
    with pytest.raises(ValueError, match="extra_info.env"):
        make_env("test_envs:Nope")
