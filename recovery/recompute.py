"""recompute (approximate): AReaL's decoupled PPO proximal policy (Fu et al. 2025, arXiv 2505.24298).

The proximal anchor is the log-prob under the parameters before this step:
one no-grad forward with the trainer's current parameters, right before the
train step. What most async systems call "old" log-probs; here it is named
for what it is, a proximal anchor (exact only for tokens of the current
version).
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class RecomputeConfig:
    """recompute has no options."""


@register
class Recompute(RecoveryStrategy):
    name = "recompute"
    Config = RecomputeConfig
    exact = False
    uses_live_trajectories = False

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        with self.meter.time("recovery_s"):
            logp_prox = self.ctx.trainer.logprobs(batch)
        return AnchorResult(logp_anchor=logp_prox, exact=False)
