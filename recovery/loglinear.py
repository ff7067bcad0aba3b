"""loglinear (approximate): AReaL's log-linear interpolation proxy, no extra forward.

The proximal policy is the one version before the policy this step produces,
v_theta = batch.version + 1 (so a fresh token, v_t = batch.version, sits at
the proximal version and gets alpha = 0: its anchor is logp_behav). For a token
sampled by v_t, interpolating in log space between the behaviour policy (at
v_t) and theta (at v_theta)::

    alpha     = clamp((v_theta - 1 - v_t) / (v_theta - v_t), 0, 1)
    logp_prox = logp_behav + alpha * (sg(logp_theta) - logp_behav)

The anchor depends on logp_theta, so ``anchor`` returns ``from_theta``, which
the trainer calls per micro-batch with its detached log-probs. Tokens outside
the loss mask get logp_behav.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.types import AnchorResult, Trajectory, TrainBatch
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class LoglinearConfig:
    """loglinear has no options."""


def proximal_alpha(mb: TrainBatch, device: torch.device | None = None) -> torch.Tensor:
    """[B, L-1] interpolation weight alpha = clamp((v_theta-1-v_t)/(v_theta-v_t), 0, 1), v_theta = mb.version + 1."""
    v_theta = float(mb.version + 1)
    v_t = mb.versions.to(device=device, dtype=torch.float32)
    return ((v_theta - 1.0 - v_t) / (v_theta - v_t).clamp(min=1.0)).clamp(0.0, 1.0)


def _inputs(logp_theta: torch.Tensor, mb: TrainBatch):
    logp_theta = logp_theta.detach().float()
    dev = logp_theta.device
    behav = mb.logp_behav.to(device=dev, dtype=torch.float32)
    valid = mb.loss_mask.to(dev) != 0
    return logp_theta, behav, valid, proximal_alpha(mb, dev)


def loglinear_anchor(logp_theta: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """logp_behav + alpha * (logp_theta - logp_behav) at policy tokens, logp_behav elsewhere."""
    logp_theta, behav, valid, alpha = _inputs(logp_theta, mb)
    return torch.where(valid, behav + alpha * (logp_theta - behav), behav)


@register
class Loglinear(RecoveryStrategy):
    name = "loglinear"
    Config = LoglinearConfig
    exact = False

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        return AnchorResult(logp_anchor=None, exact=False, from_theta=loglinear_anchor)
