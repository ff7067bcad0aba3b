"""A deterministic tool environment on the reverse_digits vocabulary, for tests and demos.

``DigitCountEnv``: the policy calls the tool by emitting SEP (token 2); the
environment answers with the number of digits in the prompt, written as
digit tokens (a 12-digit prompt -> tokens of "1", "2"). It is the one fact a
policy needs to know how long its reversed answer must be, and it depends
only on the prompt, so tests can compute every expected token by hand.
"""
from __future__ import annotations

from megarl.tasks.reverse_digits import SEP, digit_token, is_digit_token
from megarl.types import Trajectory


class DigitCountEnv:
    tool_call_id = SEP

    async def respond(self, traj: Trajectory) -> list[int]:
        n_digits = sum(is_digit_token(t) for t in traj.prompt_ids)
        return [digit_token(int(c)) for c in str(n_digits)]
