"""math_strict: only an answer the response marks as final counts (box, ####, DAPO's Answer:); scores by hand."""
import pytest

from megarl.rewards import resolve_reward_fn
from megarl.rewards.math import math_reward, math_strict_reward

LENIENT_ONLY = "Natalia sold 48 in April and 24 in May, 72 in total."

STRICT = [
    ("72", LENIENT_ONLY, 0.0),  # no marked answer: the lenient reward's free-number fallback gives 1.0
    ("42", "Adding them up gives 42.", 0.0),
    ("72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("1234", "The total is 1,000 + 234.\n#### 1,234", 1.0),
    ("8", "First \\boxed{5}. No, the carry: \\boxed{8}", 1.0),
    ("8", "I think it is \\boxed{8", 0.0),  # cut off inside the box
    ("34", "Solving step by step, x = 34.\nAnswer: 34", 1.0),  # DAPO's format
    ("34", "Answer: 12\nWait, I redo it.\nAnswer: 34.", 1.0),  # the last Answer:, its period dropped
    ("34", "Answer: 12\nWait, I redo it: 34", 0.0),  # the last marked answer is 12
    ("\\frac{1}{2}", "Answer: $\\frac{1}{2}$", 1.0),
    ("34", "Answer:", 0.0),  # marked, but empty
    ("\\frac{1}{2}", "The probability is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("7", "#### 8\nso 7 is not it", 0.0),
    ("42", "", 0.0),
]


@pytest.mark.parametrize("answer, text, expected", STRICT)
def test_strict_scores(answer, text, expected):
    assert math_strict_reward(text, answer) == expected


def test_the_lenient_reward_still_takes_a_free_number():
    assert math_reward(LENIENT_ONLY, "72") == 1.0


def test_math_strict_is_a_builtin_with_the_same_ground_truth_checks():
    assert resolve_reward_fn("math_strict") is math_strict_reward
    with pytest.raises(ValueError, match="ground truth"):
        math_strict_reward("#### 1", None)
