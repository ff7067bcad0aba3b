"""Reverse a digit string with a long-tailed length: a task a tiny model learns with RL on 2 CPU cores.

A row's prompt is a digit string ``d1..dn``; the answer is the digits reversed.
The chat template wraps the prompt (``<|im_start|>user\\n31415<|im_end|>\\n<|im_start|>assistant\\n``
with the demo's tokenizer) and the policy ends its answer with a stop token.
n = 1 + floor(Exp(mean 3)), redrawn until n <= 16, so a few prompts are long
and answer lengths are uneven (what makes asynchronous rollout matter). Both
numbers are parameters: the CPU demo's rows use mean 1 and at most 8 digits
(``--mean-extra 1 --max-digits 8``), short enough for a random-init model to
learn exact answers within minutes.

The reward is the shared per-position digit credit (megarl/rewards/digits.py):
``r = 0.75 * pos + 0.25 * len``, 1.0 only for the exact answer.

``python -m megarl.tasks.reverse_digits OUT.jsonl --n N --seed S [--mean-extra M] [--max-digits K]``
writes N rows.
"""
from __future__ import annotations

import functools
import math
import random
from pathlib import Path
from typing import Any

from megarl.rewards.digits import digit_reward
from megarl.tasks import main, write_rows

MAX_DIGITS = 16
MEAN_EXTRA_DIGITS = 3.0


def sample_length(rng: random.Random, mean_extra: float = MEAN_EXTRA_DIGITS, max_digits: int = MAX_DIGITS) -> int:
    """n = 1 + floor(Exp(mean ``mean_extra``)), redrawn until n <= ``max_digits`` (defaults: mean ~3.5)."""
    if not mean_extra > 0 or max_digits < 1:
        raise ValueError(f"reverse_digits needs mean_extra > 0 and max_digits >= 1, got {mean_extra}, {max_digits}")
    while True:
        n = 1 + math.floor(rng.expovariate(1.0 / mean_extra))
        if n <= max_digits:
            return n


def make_row(rng: random.Random, mean_extra: float = MEAN_EXTRA_DIGITS,
             max_digits: int = MAX_DIGITS) -> dict[str, str]:
    """One row ``{"prompt": "d1..dn", "answer": "dn..d1"}`` with n drawn by :func:`sample_length`."""
    digits = "".join(str(rng.randrange(10)) for _ in range(sample_length(rng, mean_extra, max_digits)))
    return {"prompt": digits, "answer": digits[::-1]}


def reward(response: str, answer: Any, *, finish_reason: str | None = "stop") -> float:
    """r = 0.75*pos + 0.25*len (megarl/rewards/digits.py); in [0, 1], 1.0 only for the exact answer."""
    return digit_reward(response, answer, finish_reason=finish_reason)


def write_jsonl(path: str | Path, n: int, seed: int, mean_extra: float = MEAN_EXTRA_DIGITS,
                max_digits: int = MAX_DIGITS) -> None:
    """Write ``n`` rows ``{"id", "prompt", "answer"}``; row i depends only on (seed, i) and the length parameters."""
    write_rows(path, n, seed, "reverse_digits", functools.partial(make_row, mean_extra=mean_extra,
                                                                 max_digits=max_digits))


OPTIONS = {
    "mean_extra": (MEAN_EXTRA_DIGITS, "mean of the exponential part of the length: n = 1 + floor(Exp(mean))"),
    "max_digits": (MAX_DIGITS, "longest prompt in digits (longer draws are redrawn)"),
}

if __name__ == "__main__":
    main("reverse_digits", make_row, __doc__.splitlines()[0], options=OPTIONS)
