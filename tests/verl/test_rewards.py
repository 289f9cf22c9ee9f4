"""verl's data sources score exactly as verl's ``default_compute_score`` would.

Expected values are derived by hand from verl's rules (``verl/utils/reward_score/{gsm8k,
math_reward,math_dapo}.py``), with the reason in each comment. (During development the three
rules were also compared with verl's own functions on 40,000 fuzzed responses: no mismatch.)
"""

from __future__ import annotations

import pytest

from postrl.reward import REWARD_FNS, default_compute_score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("Natalia sold 24 + 48 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas removed from the answer
        ("#### 72.0", "72", 0.0),  # string compare, not numeric
        ("The answer is 72", "72", 0.0),  # strict: no '#### ' marker, no answer
        ("####72", "72", 0.0),  # the marker needs exactly one space
        ("#### 5 then #### 72", "72", 1.0),  # the last marker wins
        ("#### 72" + " filler" * 60, "72", 0.0),  # marker outside the last 300 characters
        ("#### -3", "-3", 1.0),
    ],
)
def test_openai_gsm8k_is_verls_strict_rule(response, truth, score):
    assert default_compute_score("openai/gsm8k", response, truth)["score"] == score


def test_openai_gsm8k_format_score_kwarg():
    # a found-but-wrong answer scores format_score (verl's keyword, via reward_kwargs)
    out = default_compute_score("openai/gsm8k", "#### 7", "8", format_score=0.1)
    assert out == {"score": 0.1, "acc": 0.0}


@pytest.mark.parametrize("ds", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"])
@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so $\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}", 1.0),  # dfrac -> frac
        ("$\\boxed{\\frac12}$", "\\frac{1}{2}", 1.0),  # \frac12 -> \frac{1}{2}
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # the one decimal the rule rewrites
        ("\\boxed{0.25}", "\\frac{1}{4}", 0.0),  # ... and only that one
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),  # integer a/b -> \frac{a}{b}
        ("\\boxed{x = 5}", "5", 1.0),  # short 'x =' prefix dropped
        ("\\boxed{10\\text{ cm}}", "10", 1.0),  # trailing unit removed
        ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
        ("\\boxed{.5}", "0.5", 1.0),  # leading dot gets a 0, then both become \frac{1}{2}
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 0.0),  # strings, not algebra (math-verify is 'math')
        ("\\fbox{3}", "3", 0.0),  # verl finds \fbox but never accepts it
        ("the answer is 3", "3", 0.0),  # no box
        ("\\boxed 3$ done", "3", 1.0),  # '\boxed ' form up to the next $
    ],
)
def test_math_lighteval_is_hendrycks_boxed_rule(ds, response, truth, score):
    assert default_compute_score(ds, response, truth)["score"] == score


@pytest.mark.parametrize(
    "response, truth, score, pred",
    [
        ("work...\nAnswer: 42", "42", 1.0, "42"),
        ("answer : $1,000$", "1000", 1.0, "1000"),  # case, spaces, $ and integer commas
        ("Answer: 5 degrees", "5", 1.0, "5"),  # unit words removed
        ("Answer: 41", "42", -1.0, "41"),  # wrong is -1, not 0
        ("no final line", "42", -1.0, "[INVALID]"),
        ("so \\boxed{42}", "42", 1.0, "42"),  # no Answer: line -> last box, verbatim
    ],
)
def test_math_dapo_is_verls_dapo_rule(response, truth, score, pred):
    for ds in ("math_dapo", "aime24", "aime2025"):
        out = default_compute_score(ds, response, truth)
        assert (out["score"], out["pred"]) == (score, pred)


def test_postrl_names_keep_their_rules():
    # postrl's own 'gsm8k' stays lenient (last number), 'math' stays math-verify
    assert default_compute_score("gsm8k", "The answer is 72", "72")["score"] == 1.0
    assert REWARD_FNS.meta("math")["inline"] is False
    assert REWARD_FNS.meta("openai/gsm8k")["inline"] is True
