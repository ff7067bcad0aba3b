"""linear (approximate): AReaL's linear (probability-space) interpolation proxy, no extra forward.

With the same alpha as :mod:`recovery.loglinear` (v_theta = batch.version + 1;
fresh tokens v_t = batch.version get alpha = 0, anchor = logp_behav)::

    logp_prox = log((1 - alpha) * p_behav + alpha * sg(p_theta) + 1e-10)

returned as ``from_theta`` (called per micro-batch with detached log-probs);
tokens outside the loss mask get logp_behav.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.types import AnchorResult, Trajectory, TrainBatch
from recovery.base import RecoveryStrategy
from recovery.loglinear import _inputs
from recovery.registry import register

PROB_FLOOR = 1e-10
"""Added inside the log so a mixture of two vanishing probabilities stays finite (as in AReaL)."""


@dataclass
class LinearConfig:
    """linear has no options."""


def linear_anchor(logp_theta: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """log((1-alpha)*exp(logp_behav) + alpha*exp(logp_theta) + 1e-10) at policy tokens, logp_behav elsewhere."""
    logp_theta, behav, valid, alpha = _inputs(logp_theta, mb)
    mix = (1.0 - alpha) * behav.exp() + alpha * logp_theta.exp() + PROB_FLOOR
    return torch.where(valid, mix.log(), behav)


@register
class Linear(RecoveryStrategy):
    name = "linear"
    Config = LinearConfig
    exact = False

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        return AnchorResult(logp_anchor=None, exact=False, from_theta=linear_anchor)
