"""Adaptive entropy control: the entropy bonus's coefficient follows a target entropy.

A fixed bonus (``loss.entropy_coef``) is a compromise between runs: large
enough for the run whose policy collapses onto one answer per prompt (every
sample of a group the same, no advantage left) and it slows the runs that
would have kept exploring anyway. With ``loss.entropy_target`` set, the
coefficient starts at ``loss.entropy_coef`` and moves after every train step
by ``loss.entropy_coef_step``: up while the step's mean policy entropy (nats
per policy token, the ``entropy`` metric) is below the target, down while it
is at or above it, kept within ``[loss.entropy_coef_min, loss.entropy_coef_max]``. The bonus then
acts on a collapsing run and fades where the entropy stays up by itself
(adaptive entropy control, He et al., 2025, "Skywork Open Reasoner 1
Technical Report", arXiv:2505.22312).

The controller's trainer rank owns the coefficient: it uses the value for a
step, observes the step's entropy (reduced over micro-batches, data-parallel
ranks and pipeline stages by the trainer) and sends the value it used to the
other trainer ranks with the step, so every rank trains with the same loss.
The coefficient is part of the loop's checkpoint: a resumed run goes on with
the value it had.
"""
from __future__ import annotations

import math
from typing import Any


class EntropyControl:
    """The entropy bonus's coefficient: fixed (``target`` None) or adapted after each step (module doc)."""

    def __init__(self, coef: float, target: float | None = None, step: float = 0.0, max_coef: float = 0.0,
                 min_coef: float = 0.0) -> None:
        self.coef = float(coef)
        self.target = None if target is None else float(target)
        self.step = float(step)
        self.max_coef = float(max_coef)
        self.min_coef = float(min_coef)

    @classmethod
    def from_config(cls, loss_cfg: Any) -> "EntropyControl":
        return cls(loss_cfg.entropy_coef, loss_cfg.entropy_target, loss_cfg.entropy_coef_step,
                   loss_cfg.entropy_coef_max, loss_cfg.entropy_coef_min)

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    @property
    def active(self) -> bool:
        """Whether the loss needs the policy's entropy: a bonus now, or a target to follow."""
        return self.coef > 0 or self.adaptive

    def observe(self, entropy: float | None) -> None:
        """Move the coefficient after a step whose mean policy entropy was ``entropy`` (None or not finite, e.g.
        a skipped step without policy tokens: unchanged)."""
        if not self.adaptive or entropy is None or not math.isfinite(entropy):
            return
        moved = self.coef + (self.step if entropy < self.target else -self.step)
        self.coef = min(max(moved, self.min_coef), self.max_coef)

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "entropy_coef" in state:
            self.coef = float(state["entropy_coef"])
