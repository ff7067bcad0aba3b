"""Text arithmetic problems for the math reward: ``What is 17 + 5? Put the answer in \\boxed{}.`` -> ``22``.

Rows ``{"id", "prompt", "answer"}`` scored by the built-in ``math`` reward
(math-verify). A random tiny model does not solve them; they exist to run the
whole text path (chat template, EOS, decoding, math-verify) end to end.

``python -m megarl.tasks.arithmetic OUT.jsonl --n N --seed S`` writes N rows.
"""
from __future__ import annotations

import random
from pathlib import Path

from megarl.tasks import main, write_rows

OPS = ("+", "-", "*")


def make_row(rng: random.Random) -> dict[str, str]:
    a, b, op = rng.randrange(1, 50), rng.randrange(1, 20), rng.choice(OPS)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"What is {a} {op} {b}? Put the answer in \\boxed{{}}.", "answer": str(value)}


def write_jsonl(path: str | Path, n: int, seed: int) -> None:
    """Write ``n`` rows ``{"id", "prompt", "answer"}``; row i depends only on (seed, i)."""
    write_rows(path, n, seed, "arithmetic", make_row)


if __name__ == "__main__":
    main("arithmetic", make_row, __doc__.splitlines()[0])
