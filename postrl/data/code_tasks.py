"""``code``: small generated programming tasks, scored by running the model's program in the
sandbox against the row's test cases.

Rows (verl schema): ``data_source="code"``, the prompt asks for a Python function ``f`` inside a
```` ```python ```` block, ``reward_model.ground_truth`` is a JSON list of
``{"input": [args...], "output": value}``, ``extra_info`` holds ``fn_name`` and a
``reference_solution`` (used by tests and demonstrations).

Scoring (:func:`compute_code_score`): the last ```` ```python ```` (else the last ```` ``` ````)
block of the response is written to ``solution.py``; a harness in the sandbox imports it, calls
``f(*input)`` for each test and prints only the **return values** (never seeing the expected
outputs, which stay in the trainer, so the program cannot read or fake them); the trainer
compares them (JSON-normalised; floats with ``math.isclose``, rel 1e-6). The result is a dict::

    {"score": passed / total, "passed": k, "total": n,
     "error": None | "why nothing or not everything ran",   # e.g. "no ```python block", a
                                                            # SyntaxError, "[sandbox: timeout: ...]"
     "infra_error": 0.0 | 1.0}                              # 1.0: the sandbox itself failed
                                                            # (refused / setup_failed): the score
                                                            # says nothing about the model

Failures are never silent zeros: ``error`` always says why a score is below 1, and
``infra_error`` lets the reward loop drop samples the sandbox could not judge.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import secrets
import threading
from collections.abc import Callable
from typing import Any

from postrl.tools.sandbox import Sandbox, SandboxConfig

__all__ = [
    "SandboxUnavailableError",
    "code_reward",
    "compute_code_score",
    "compute_code_score_async",
    "extract_code",
    "generate_code_tasks",
]

# (description template, reference source template, input generator)
_Spec = tuple[str, str, Callable[[random.Random], list[Any]]]


def _ints(rng: random.Random, lo: int = -50, hi: int = 50) -> list[Any]:
    return [rng.randint(lo, hi)]


def _word(rng: random.Random) -> list[Any]:
    return ["".join(rng.choice("abcdeiou xyz") for _ in range(rng.randint(0, 12)))]


def _intlist(rng: random.Random) -> list[Any]:
    return [[rng.randint(-20, 20) for _ in range(rng.randint(1, 8))]]


_SPECS: list[_Spec] = [
    ("returns x * x + {k}", "def f(x):\n    return x * x + {k}\n", _ints),
    ("returns {k} * x - {m}", "def f(x):\n    return {k} * x - {m}\n", _ints),
    (
        "returns the sum of the decimal digits of abs(x)",
        "def f(x):\n    return sum(int(c) for c in str(abs(x)))\n",
        lambda r: _ints(r, -(10**6), 10**6),
    ),
    ("returns the string s reversed", "def f(s):\n    return s[::-1]\n", _word),
    (
        "returns the number of vowels (a, e, i, o, u) in the string s",
        "def f(s):\n    return sum(c in 'aeiou' for c in s)\n",
        _word,
    ),
    (
        "returns how many times the character '{c}' occurs in the string s",
        "def f(s):\n    return s.count('{c}')\n",
        _word,
    ),
    (
        "returns the largest element of the non-empty list xs",
        "def f(xs):\n    return max(xs)\n",
        _intlist,
    ),
    (
        "returns the list xs sorted in descending order",
        "def f(xs):\n    return sorted(xs, reverse=True)\n",
        _intlist,
    ),
    (
        "returns the sum of the elements of xs that are divisible by {k}",
        "def f(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
        _intlist,
    ),
    (
        "returns True if x is a prime number and False otherwise",
        "def f(x):\n    return x > 1 and all(x % d for d in range(2, int(x ** 0.5) + 1))\n",
        lambda r: _ints(r, -5, 100),
    ),
    (
        "returns the x-th Fibonacci number, with f(0) = 0 and f(1) = 1",
        "def f(x):\n    a, b = 0, 1\n    for _ in range(x):\n"
        "        a, b = b, a + b\n    return a\n",
        lambda r: _ints(r, 0, 40),
    ),
    (
        "returns x with its decimal digits reversed, keeping the sign (e.g. -120 -> -21)",
        "def f(x):\n    s = -1 if x < 0 else 1\n    return s * int(str(abs(x))[::-1])\n",
        lambda r: _ints(r, -(10**5), 10**5),
    ),
]


def _run_reference(src: str, args: list[Any]) -> Any:
    ns: dict[str, Any] = {}
    exec(src, ns)  # noqa: S102 - our own reference solutions, never model output
    return ns["f"](*args)


def generate_code_tasks(
    n: int, seed: int = 0, split: str = "train", num_tests: int = 5
) -> list[dict[str, Any]]:
    """``n`` seeded programming tasks with ``num_tests`` test cases each (see module docstring).

    Train and test use different random streams (different constants and inputs)."""
    rng = random.Random(seed * 1_000_003 + {"train": 0}.get(split, 7919) + 31)
    rows = []
    for i in range(n):
        desc, ref, gen = _SPECS[rng.randrange(len(_SPECS))]
        params = {"k": rng.randint(2, 9), "m": rng.randint(1, 30), "c": rng.choice("aeixyz")}
        desc, ref = desc.format(**params), ref.format(**params)
        tests, seen = [], set()
        for _ in range(num_tests * 10):
            args = gen(rng)
            key = json.dumps(args)
            if key in seen:
                continue
            seen.add(key)
            tests.append({"input": args, "output": _run_reference(ref, args)})
            if len(tests) == num_tests:
                break
        prompt = (
            f"Write a Python function f that {desc}.\n"
            "Answer with the complete function in a ```python code block."
        )
        rows.append(
            {
                "data_source": "code",
                "prompt": [{"role": "user", "content": prompt}],
                "ability": "code",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "fn_name": "f",
                    "reference_solution": ref,
                },
            }
        )
    return rows


_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = """import json, os, sys
sys.path.insert(0, os.getcwd())
sys.setrecursionlimit(10000)
try:
    import solution
    fn = getattr(solution, {fn_name!r})
except BaseException as e:
    print({marker!r} + json.dumps({{"import_error": type(e).__name__ + ": " + str(e)[:300]}}))
    raise SystemExit(0)
out = []
for args in {inputs!r}:
    try:
        out.append(["ok", json.loads(json.dumps(fn(*json.loads(args)), default=repr))])
    except BaseException as e:
        out.append(["error", type(e).__name__ + ": " + str(e)[:200]])
print({marker!r} + json.dumps({{"results": out}}), flush=True)
"""


def extract_code(text: str) -> str | None:
    """The last ```python block of ``text`` (else the last fenced block), or None."""
    blocks = _FENCE.findall(text)
    py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    return blocks[-1][1] if blocks else None


def _equal(got: Any, want: Any) -> bool:
    if isinstance(want, float) or isinstance(got, float):
        try:
            return math.isclose(float(got), float(want), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_equal(g, w) for g, w in zip(got, want))
    return type(got) is type(want) and got == want


async def compute_code_score_async(
    solution_str: str, ground_truth: str | list, sandbox: Sandbox, fn_name: str = "f"
) -> dict[str, Any]:
    """Async version of :func:`compute_code_score`."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else list(ground_truth)
    total = len(tests)
    result: dict[str, Any] = {
        "score": 0.0,
        "passed": 0,
        "total": total,
        "error": None,
        "infra_error": 0.0,
    }
    code = extract_code(solution_str)
    if code is None:
        result["error"] = "no ```python code block in the response"
        return result
    marker = f"@@postrl-results-{secrets.token_hex(8)}@@"
    inputs = [json.dumps(t["input"]) for t in tests]
    harness = _HARNESS.format(fn_name=fn_name, marker=marker, inputs=inputs)
    res = await sandbox.run(
        [sandbox.python, "-I", "-S", "main.py"], {"main.py": harness, "solution.py": code}
    )
    if res.status in ("refused", "setup_failed"):
        result.update(error=res.describe(), infra_error=1.0)
        return result
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        result["error"] = f"{res.describe()} {res.stderr[-300:]}".strip()
        return result
    payload = json.loads(lines[-1][len(marker) :])
    if "import_error" in payload:
        result["error"] = f"solution failed to load: {payload['import_error']}"
        return result
    outcomes = payload["results"]
    passed = sum(st == "ok" and _equal(val, t["output"]) for (st, val), t in zip(outcomes, tests))
    errors = [val for st, val in outcomes if st == "error"]
    result.update(score=passed / max(total, 1), passed=passed)
    if passed < total:
        result["error"] = f"{total - passed} of {total} tests failed" + (
            f"; first exception: {errors[0]}" if errors else ""
        )
    return result


def compute_code_score(
    solution_str: str, ground_truth: str | list, sandbox: Sandbox | None = None, fn_name: str = "f"
) -> dict[str, Any]:
    """Fraction of test cases the response's program passes, run in ``sandbox``.

    Synchronous wrapper; safe to call from inside a running event loop (it then runs on a
    helper thread). Returns the dict described in the module docstring.
    """
    sandbox = sandbox or _default_sandbox()

    def coro_fn() -> Any:
        return compute_code_score_async(solution_str, ground_truth, sandbox, fn_name)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(coro_fn())))
    t.start()
    t.join()
    return box["r"]


_SANDBOXES: dict[SandboxConfig, Sandbox] = {}


class SandboxUnavailableError(RuntimeError):
    """The sandbox could not judge the program (refused for missing isolation, or failed to
    start). Raised by :func:`code_reward` so the reward loop reports the sample as failed
    (``reward/failed/exception``) instead of scoring the model 0 for an infrastructure fault."""


def _default_sandbox(sandbox_config: dict[str, Any] | None = None) -> Sandbox:
    """The process-wide sandbox for ``sandbox_config`` (:class:`SandboxConfig` fields)."""
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in (sandbox_config or {}).items()}
    if not kw:
        kw = {"wall_time_s": 5.0, "cpu_time_s": 3, "memory_mb": 512}
    cfg = SandboxConfig(**kw)
    if cfg not in _SANDBOXES:
        _SANDBOXES[cfg] = Sandbox(cfg)
    return _SANDBOXES[cfg]


def code_reward(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    sandbox_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl-signature reward for ``data_source="code"`` (a process-wide sandbox).

    Args:
        sandbox_config: :class:`SandboxConfig` fields for the sandbox that runs the programs
            (set it through ``reward.reward_kwargs.sandbox_config``); default 5 s wall, 3 s CPU,
            512 MiB.

    The ``error`` string is dropped (reward dicts carry numbers).

    Raises:
        SandboxUnavailableError: the sandbox refused or failed to start; the sample has no
            score (the reward loop counts it as failed, with this message as the detail).
    """
    fn_name = (extra_info or {}).get("fn_name", "f")
    out = compute_code_score(
        solution_str, ground_truth, sandbox=_default_sandbox(sandbox_config), fn_name=fn_name
    )
    if out["infra_error"]:
        raise SandboxUnavailableError(
            f"code reward not computed, sandbox unavailable: {out['error']}"
        )
    if out["error"]:
        import logging

        logging.getLogger(__name__).debug("code reward: %s", out["error"])
    return {"score": out["score"], "passed": float(out["passed"]), "total": float(out["total"])}


def _register() -> None:
    """Register ``code_reward`` under ``code`` unless an entry (e.g. a lazy one) exists."""
    try:
        from postrl.reward.registry import REWARD_FNS
    except ImportError:  # pragma: no cover
        return
    if "code" not in REWARD_FNS:
        REWARD_FNS.add("code", code_reward, batch=False, inline=False)


_register()
