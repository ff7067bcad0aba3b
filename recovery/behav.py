"""behav: bypass — the anchor is the engine's own log-prob (no correction).

With ``loss.behav_weight=none`` this is standard PPO on the behaviour policy;
it is the baseline every other strategy is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class BehavConfig:
    """behav has no options."""


@register
class Behav(RecoveryStrategy):
    name = "behav"
    Config = BehavConfig
    exact = False
    uses_live_trajectories = False

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        return AnchorResult(logp_anchor=batch.logp_behav.clone(), exact=False)
