"""DAPO's soft overlong punishment (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", section 3.4): a response that runs into the last ``buffer`` tokens before the length limit L_max
loses reward linearly, up to ``penalty`` at L_max::

    R_length(L) = 0                                   L <= L_max - buffer
                = -penalty * (L - (L_max - buffer)) / buffer     L_max - buffer < L <= L_max

It is added to the reward of every training sample (a failed reward stays failed), never to evaluation:
held-out numbers score the answer alone. Off with ``reward.overlong_buffer = 0``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OverlongPenalty:
    max_len: int
    """L_max: the response length limit (rollout.max_new_tokens)."""
    buffer: int
    """Tokens before L_max over which the penalty grows from 0 to ``penalty``."""
    penalty: float = 1.0
    """The reward lost by a response of L_max tokens."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer <= self.max_len:
            raise ValueError(f"overlong buffer {self.buffer} must be in (0, max_len={self.max_len}]")

    def __call__(self, length: int) -> float:
        start = self.max_len - self.buffer
        if length <= start:
            return 0.0
        return -self.penalty * min(length - start, self.buffer) / self.buffer


def overlong_penalty(cfg) -> OverlongPenalty | None:
    """The run's penalty from ``reward.overlong_buffer`` / ``overlong_penalty`` (checked by the preflight)."""
    if cfg.reward.overlong_buffer <= 0:
        return None
    return OverlongPenalty(cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
