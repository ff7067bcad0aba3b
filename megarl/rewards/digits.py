"""Per-position digit credit: the reward of answers that are digit strings (reverse_digits, long_arithmetic).

On the decoded response ``out`` (special tokens skipped) and the answer ``tgt``::

    pos = #{i: out[i] == tgt[i]} / max(|out|, |tgt|)
    len = 0 if the response did not end on a stop token else max(0, 1 - abs(|out| - |tgt|) / |tgt|)
    r   = 0.75 * pos + 0.25 * len

Each right digit in its place earns credit, so a model that gets part of the
answer right (or copies part of it from a tool's result) has signal; ``len``
keeps the length distribution honest: rewarding ``pos`` alone learns faster
but collapses output lengths into buckets.
"""
from __future__ import annotations

from typing import Any


def digit_reward(response: str, answer: Any, *, finish_reason: str | None = "stop") -> float:
    """r = 0.75*pos + 0.25*len (module docstring); in [0, 1], 1.0 only for the exact answer."""
    tgt = str(answer)
    if not tgt:
        raise ValueError("the digits reward needs a non-empty answer")
    out = response
    pos = sum(o == t for o, t in zip(out, tgt)) / max(len(out), len(tgt))
    length = max(0.0, 1.0 - abs(len(out) - len(tgt)) / len(tgt)) if finish_reason == "stop" else 0.0
    return 0.75 * pos + 0.25 * length
