"""linear (approximate): AReaL's linear (probability-space) interpolation proxy, no extra forward.

With the same alpha as :mod:`recovery.loglinear`, under the same two v_theta
conventions (``convention``: megarl, v_theta = batch.version + 1, where fresh
tokens get alpha = 0 and anchor = logp_behav; areal, v_theta = batch.version)::

    logp_prox = log((1 - alpha) * p_behav + alpha * sg(p_theta) + 1e-10)

returned as ``from_theta`` (called per micro-batch with detached log-probs), or
as a tensor from one no-grad forward when the loss's token count depends on it
(:func:`recovery.loglinear.interpolated_anchor`); tokens outside the loss mask
get logp_behav.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.types import TrainBatch
from recovery.loglinear import Convention, Interpolation, interp_inputs
from recovery.registry import register

PROB_FLOOR = 1e-10
"""Added inside the log so a mixture of two vanishing probabilities stays finite (as in AReaL)."""


@dataclass
class LinearConfig:
    """Options of the linear strategy."""

    convention: Convention = "megarl"
    """v_theta of the interpolation: megarl = trainer version + 1 (the policy this step produces), areal = the trainer's version (AReaL's compute_prox_logp_approximations); docs/design.md §2."""


def linear_anchor(logp_theta: torch.Tensor, mb: TrainBatch, convention: Convention = "megarl") -> torch.Tensor:
    """log((1-alpha)*exp(logp_behav) + alpha*exp(logp_theta) + 1e-10) at policy tokens, logp_behav elsewhere."""
    logp_theta, behav, valid, alpha = interp_inputs(logp_theta, mb, convention)
    mix = (1.0 - alpha) * behav.exp() + alpha * logp_theta.exp() + PROB_FLOOR
    return torch.where(valid, mix.log(), behav)


@register
class Linear(Interpolation):
    name = "linear"
    Config = LinearConfig
    interpolate = staticmethod(linear_anchor)
