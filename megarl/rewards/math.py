"""Math answer equivalence with math-verify (``parse`` + ``verify``).

Reward 1.0 when the response's final answer is mathematically equal to the
ground truth (``\\frac{1}{2}`` equals ``0.5``; a ``\\boxed{}`` answer or a
plain final number), else 0.0. A ground truth math-verify cannot parse
raises: that is bad data, and a failed sample shows up in the service's
stats where a silent 0.0 would not.
"""
from __future__ import annotations

from typing import Any

from math_verify import parse, verify


def math_reward(response: str, answer: Any, **_: Any) -> float:
    if answer is None or str(answer).strip() == "":
        raise ValueError("math reward needs the ground truth (data.answer_key) of every row")
    gold = parse(str(answer))
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {answer!r}")
    pred = parse(response)
    # verify(gold, pred) is not symmetric: the ground truth goes first
    return 1.0 if verify(gold, pred) else 0.0
