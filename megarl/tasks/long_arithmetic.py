"""Arithmetic on numbers too long for a tiny model to work out: ``4821*907`` -> ``4372647``.

Rows ``{"id", "prompt", "answer"}``: the prompt is ``A OP B`` with no spaces
(OP is ``+`` or ``*``), the answer the exact result as a digit string. A
product has operands of 2 to ``mul_digits`` digits, a sum of 2 to
``add_digits`` (defaults: answers of 2 to 6 digits; ``answer_digits`` fixes
the answer's length: configs/tiny_calc_agent_cpu.yaml uses 3). The built-in
``calculator`` agent (megarl/workflows/calculator.py) lets the model call a
calculator on the two operands; the ``digits`` reward (megarl/rewards/digits.py)
scores the final answer digit by digit.

``python -m megarl.tasks.long_arithmetic OUT.jsonl --n N --seed S [--ops OPS] [--mul-digits K] [--add-digits K]
[--answer-digits K]``
writes N rows.
"""
from __future__ import annotations

import random

from megarl.tasks import main

OPS = "+*"
MUL_DIGITS = 3
ADD_DIGITS = 5


def _operand(rng: random.Random, max_digits: int) -> int:
    """A number of 2 to ``max_digits`` digits (the number of digits drawn uniformly first)."""
    n = rng.randint(2, max_digits)
    return rng.randrange(10 ** (n - 1), 10 ** n)


def make_row(rng: random.Random, ops: str = OPS, mul_digits: int = MUL_DIGITS, add_digits: int = ADD_DIGITS,
             answer_digits: int = 0) -> dict[str, str]:
    """One row ``{"prompt": "A*B", "answer": "A*B's value"}`` with OP drawn from ``ops``; with ``answer_digits``
    > 0, drawn again until the answer has exactly that many digits."""
    if not ops or set(ops) - set(OPS) or min(mul_digits, add_digits) < 2:
        raise ValueError(f"long_arithmetic needs ops from {OPS!r} and operands of at least 2 digits, got "
                         f"ops={ops!r}, mul_digits={mul_digits}, add_digits={add_digits}")
    for _ in range(1000):
        op = rng.choice(ops)
        digits = mul_digits if op == "*" else add_digits
        a, b = _operand(rng, digits), _operand(rng, digits)
        answer = str(a * b if op == "*" else a + b)
        if answer_digits <= 0 or len(answer) == answer_digits:
            return {"prompt": f"{a}{op}{b}", "answer": answer}
    raise ValueError(f"long_arithmetic: no answer of {answer_digits} digits in 1000 draws with ops={ops!r}, "
                     f"mul_digits={mul_digits}, add_digits={add_digits}")


OPTIONS = {
    "ops": (OPS, "operators to draw from (a subset of '+*')"),
    "mul_digits": (MUL_DIGITS, "most digits of a product's operands"),
    "add_digits": (ADD_DIGITS, "most digits of a sum's operands"),
    "answer_digits": (0, "if > 0, every answer has exactly this many digits (rows are drawn again until it has)"),
}

if __name__ == "__main__":
    main("long_arithmetic", make_row, __doc__.splitlines()[0], options=OPTIONS)
