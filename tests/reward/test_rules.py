"""Built-in rule scorers on hand-written cases (expected values derived by reading each case)."""

from __future__ import annotations

import pytest

from postrl.reward import REWARD_FNS, default_compute_score
from postrl.reward.registry import register_reward_fn
from postrl.reward.rules import countdown, math_answer
from postrl.reward.rules.addition import last_integer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("579", 579),
        ("The answer is 579.", 579),
        ("123+456=579", 579),  # echoes the question; the last integer is the answer
        ("123-456", 456),  # a minus after a digit is binary, not a sign
        ("it is -5", -5),
        ("1,234", 1234),  # strict thousands grouping
        ("1,23", 23),  # not a thousands group: two integers, the last is 23
        ("12,3456", 3456),
        ("no digits", None),
        ("", None),
    ],
)
def test_last_integer(text, expected):
    assert last_integer(text) == expected


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("579", "579", 1.0),
        ("I think 578 then 579", "579", 1.0),
        ("579 is wrong, it is 580", "579", 0.0),
        ("nothing", "579", 0.0),
        ("-12", "-12", 1.0),
        ("1,234", "1234", 1.0),
    ],
)
def test_addition(response, truth, score):
    out = default_compute_score("addition", response, truth)
    assert out == {"score": score, "acc": score}


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("1044", "1044", 1.0),  # exact: full score whatever the partial weight
        ("1034", "1044", 0.5 * 3 / 4),  # three of four digits
        ("44", "1044", 0.5 * 2 / 4),  # missing digits are wrong
        ("21044", "1044", 0.5 * 4 / 5),  # an extra digit is wrong
        ("-1044", "1044", 0.0),  # wrong sign
        ("none", "1044", 0.0),
    ],
)
def test_addition_partial_credit(response, truth, score):
    out = default_compute_score("addition", response, truth, partial_credit=0.5)
    assert out["score"] == pytest.approx(score)
    assert out["acc"] == float(score == 1.0)


def test_addition_partial_credit_range_is_checked():
    with pytest.raises(ValueError, match=r"partial_credit=1.0 must be in \[0, 1\)"):
        default_compute_score("addition", "1", "1", partial_credit=1.0)


CD = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize(
    "response, score",
    [
        ("<answer>(2+4)*4</answer>", 0.0),  # 4 used twice, 3 unused
        ("<answer>2*3*4</answer>", 1.0),
        ("<answer>4*3*2 = 24</answer>", 1.0),  # '= 24' tail dropped
        ("<answer>1+1</answer> then <answer>(3*4)*2</answer>", 1.0),  # last answer counts
        ("Let me think.\n2*3*4\nDone", 1.0),  # bare expression line ('Done' is not one)
        ("<answer>2*3+4</answer>", 0.0),  # right numbers, wrong value (10)
        ("<answer>2**3*3</answer>", 0.0),  # ** is rejected
        ("<answer>__import__('os')</answer>", 0.0),  # names/calls are rejected
        ("<answer>4/(3-3)*2</answer>", 0.0),  # divides by zero (and wrong numbers)
        ("<answer>" + "+".join(["2"] * 200) + "</answer>", 0.0),  # over MAX_EXPR_CHARS
        ("no equation here", 0.0),
    ],
)
def test_countdown(response, score):
    assert countdown.compute_score("countdown", response, CD)["score"] == score


def test_countdown_division_exact_and_format_bonus():
    # 4 / (1 - 5/6) = 4 / (1/6) = 24: exact with Fractions (floats would give 23.999999999999996)
    gt = {"target": 24, "numbers": [4, 1, 5, 6]}
    assert countdown.compute_score("countdown", "<answer>4/(1-5/6)</answer>", gt)["score"] == 1.0
    # well-formed but wrong -> format_score; not parseable -> 0 even with a bonus configured
    assert countdown.compute_score(
        "countdown", "<answer>4+1+5+6</answer>", gt, format_score=0.1
    ) == {
        "score": 0.1,
        "acc": 0.0,
    }
    assert (
        countdown.compute_score("countdown", "<answer>4+</answer>", gt, format_score=0.1)["score"]
        == 0.0
    )


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("Janet has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18\n#### 18", "18", 1.0),
        ("#### 18 and later 99", "18", 1.0),  # number right after the marker wins
        ("She pays $1,234.00 in total.", "1234", 1.0),  # no marker: last number, $ and , stripped
        ("The answer is 17.", "18", 0.0),
        ("x\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # raw GSM8K ground truth
        ("no number", "5", 0.0),
        ("#### -3.5", "-3.5", 1.0),
    ],
)
def test_gsm8k(response, truth, score):
    # postrl's lenient rule; verl's strict openai/gsm8k rule is tested in tests/verl/
    assert default_compute_score("gsm8k", response, truth)["score"] == score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),  # equivalent forms
        ("Thus $\\boxed{\\dfrac{1}{2}}$", "\\frac12", 1.0),
        ("The answer is $\\boxed{3}$", "4", 0.0),
        ("$\\boxed{x^2+2x+1}$", "(x+1)^2", 1.0),
    ],
)
def test_math_verify(response, truth, score):
    pytest.importorskip("math_verify")
    # verl's MATH data sources use verl's own rule (tests/verl/test_rewards.py)
    assert default_compute_score("math", response, truth)["score"] == score


def test_math_fallback_without_math_verify(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError("simulated: math_verify missing")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    monkeypatch.setattr(math_answer, "_WARNED", False)
    with caplog.at_level("WARNING"):
        ok = math_answer.compute_score("math", "so $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}")
        bad = math_answer.compute_score("math", "so $\\boxed{0.5}$", "\\frac{1}{2}")
        math_answer.compute_score("math", "no box", "1")
    assert ok["score"] == 1.0
    assert bad["score"] == 0.0  # the string fallback misses equivalent forms (documented)
    warnings = [r for r in caplog.records if "math-verify is not installed" in r.message]
    assert len(warnings) == 1  # warned once


def test_last_boxed_nested_braces():
    assert math_answer.last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert math_answer.last_boxed("\\boxed{unclosed") is None


def test_registry_names_and_errors():
    for name in ("addition", "countdown", "gsm8k", "openai/gsm8k", "math", "lighteval/MATH"):
        assert name in REWARD_FNS
    assert REWARD_FNS.meta("addition")["inline"] is True
    assert REWARD_FNS.meta("math")["inline"] is False  # sympy can hang: killable worker
    with pytest.raises(KeyError, match="did you mean 'gsm8k'"):
        REWARD_FNS.get("gsm8kk")
    with pytest.raises(KeyError, match="already registered"):
        register_reward_fn("addition")(lambda *a: 0.0)


def test_format_reward():
    from postrl.reward import format_reward

    pat = r"<think>.*</think>\s*<answer>.*</answer>"
    assert format_reward("<think>a\nb</think> <answer>3</answer>", pat, bonus=0.2) == 0.2
    assert format_reward("<answer>3</answer>", pat, bonus=0.2) == 0.0
