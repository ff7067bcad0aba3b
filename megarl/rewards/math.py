"""Math answer equivalence with math-verify (``parse`` + ``verify``).

Reward 1.0 when the response's final answer is mathematically equal to
``meta["answer"]`` (``\\frac{1}{2}`` equals ``0.5``), else 0.0. The response
text comes from ``meta["response_text"]`` (see :mod:`megarl.rewards`). A
reference answer math-verify cannot parse raises: that is bad data, and a
failed sample shows up in the service's stats where a silent 0.0 would not.
"""
from __future__ import annotations

from typing import Any

from math_verify import parse, verify

from megarl.rewards import response_text


def math_reward(response_ids: list[int], meta: dict[str, Any]) -> float:
    if "answer" not in meta:
        raise ValueError("math reward needs the reference answer in meta['answer']")
    gold = parse(str(meta["answer"]))
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {meta['answer']!r}")
    pred = parse(response_text(meta))
    # verify(gold, pred) is not symmetric: the reference goes first
    return 1.0 if verify(gold, pred) else 0.0
