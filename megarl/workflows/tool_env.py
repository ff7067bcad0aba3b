"""A deterministic tool environment for the reverse_digits task, for tests and demos.

``DigitCountEnv``: the policy calls the tool by emitting a newline; the
environment answers with the number of digits in the prompt, as text encoded
by the run's tokenizer (a 12-digit prompt -> the tokens of "12"). It is the
one fact a policy needs to know how long its reversed answer must be, and it
depends only on the prompt, so tests can compute every expected token by hand.
"""
from __future__ import annotations

from typing import Any

from megarl.errors import ConfigError
from megarl.types import Trajectory

TOOL_CALL = "\n"


class DigitCountEnv:
    def __init__(self, tokenizer: Any) -> None:
        ids = tokenizer.hf.encode(TOOL_CALL, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(f"the digit_count tool is called with a newline, which the tokenizer {tokenizer.source} "
                              f"encodes as {len(ids)} tokens; it needs exactly one")
        self.tokenizer = tokenizer
        self.tool_call_id = ids[0]

    async def respond(self, traj: Trajectory) -> list[int]:
        n_digits = sum(c.isdigit() for c in self.tokenizer.decode_prompt(traj.prompt_ids))
        return self.tokenizer.hf.encode(str(n_digits), add_special_tokens=False)
