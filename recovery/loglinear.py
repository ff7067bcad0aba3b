"""loglinear (approximate): AReaL's log-linear interpolation proxy, no extra forward.

For a token sampled by v_t, interpolating in log space between the behaviour
policy (at v_t) and theta (at v_theta), with the proximal policy one version
before v_theta::

    alpha     = clamp((v_theta - 1 - v_t) / (v_theta - v_t), 0, 1)   (0 where v_t = v_theta)
    logp_prox = logp_behav + alpha * (sg(logp_theta) - logp_behav)

Two conventions for v_theta (``convention``; docs/design.md §2), with k =
batch.version, the trainer's version when the batch is formed (its parameters
are the ones the step differentiates):

- ``megarl``: v_theta = k + 1, the policy this step produces; the proximal
  policy is k, the parameters before the step. A fresh token (v_t = k) gets
  alpha = 0, a one-version-old token (v_t = k - 1) alpha = 1/2.
- ``areal``: v_theta = k, as AReaL's ``compute_prox_logp_approximations``
  takes the trainer's current version; the proximal policy is k - 1 (the last
  one broadcast before it). Tokens of k and k - 1 get alpha = 0, a token of
  k - 2 alpha = 1/2.

The anchor depends on logp_theta, so ``anchor`` returns ``from_theta``, which
the trainer calls per micro-batch with its detached log-probs. Tokens outside
the loss mask get logp_behav. When the loss's token count depends on the
anchor (``loss.denominator=kept`` under a behaviour mask), the count must be
known before the first micro-batch's backward, so the anchor is then computed
up front from one no-grad forward (see :func:`interpolated_anchor`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ClassVar, Literal

import torch

from megarl.losses import PolicyLossConfig
from megarl.losses.policy import normalizer_needs_anchor
from megarl.types import NO_VERSION, AnchorResult, TrainBatch, Trajectory
from recovery.base import RecoveryStrategy
from recovery.registry import register

#: the v_theta conventions (module docstring)
CONVENTIONS = ("megarl", "areal")

Convention = Literal["megarl", "areal"]


@dataclass
class LoglinearConfig:
    """Options of the loglinear strategy."""

    convention: Convention = "megarl"
    """v_theta of the interpolation: megarl = trainer version + 1 (the policy this step produces), areal = the trainer's version (AReaL's compute_prox_logp_approximations); docs/design.md §2."""


def proximal_alpha(mb: TrainBatch, device: torch.device | None = None,
                   convention: Convention = "megarl") -> torch.Tensor:
    """[B, L-1] alpha = clamp((v_theta-1-v_t)/(v_theta-v_t), 0, 1); v_theta = mb.version + 1 (megarl) or
    mb.version (areal); 0 where v_t >= v_theta and at tokens no policy sampled."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r} is not one of {list(CONVENTIONS)}")
    v_theta = float(mb.version + 1 if convention == "megarl" else mb.version)
    v_t = mb.versions.to(device=device, dtype=torch.float32)
    alpha = ((v_theta - 1.0 - v_t) / (v_theta - v_t).clamp(min=1.0)).clamp(0.0, 1.0)
    return torch.where(mb.versions.to(device) == NO_VERSION, torch.zeros_like(alpha), alpha)


def interp_inputs(logp_theta: torch.Tensor, mb: TrainBatch, convention: Convention):
    """(detached fp32 logp_theta, logp_behav, policy-token mask, alpha) on logp_theta's device."""
    logp_theta = logp_theta.detach().float()
    dev = logp_theta.device
    behav = mb.logp_behav.to(device=dev, dtype=torch.float32)
    valid = mb.loss_mask.to(dev) != 0
    return logp_theta, behav, valid, proximal_alpha(mb, dev, convention)


def loglinear_anchor(logp_theta: torch.Tensor, mb: TrainBatch, convention: Convention = "megarl") -> torch.Tensor:
    """logp_behav + alpha * (logp_theta - logp_behav) at policy tokens, logp_behav elsewhere."""
    logp_theta, behav, valid, alpha = interp_inputs(logp_theta, mb, convention)
    return torch.where(valid, behav + alpha * (logp_theta - behav), behav)


def interpolated_anchor(strategy: RecoveryStrategy, batch: TrainBatch,
                        fn: Callable[[torch.Tensor, TrainBatch], torch.Tensor]) -> AnchorResult:
    """The AnchorResult of an interpolation ``fn(logp_theta, batch)``: ``from_theta``, or a tensor when needed.

    With ``loss.denominator=kept`` under a bounded behaviour mask the loss divides
    every micro-batch by the number of tokens the anchor keeps over the whole
    batch, and that number must be known before the first micro-batch's backward.
    It is computed exactly from one no-grad forward of the current parameters:
    they are the parameters the step differentiates (the optimizer steps after
    the last micro-batch), so these are the values of sg(logp_theta), and the
    loss then uses this very tensor as its anchor, so its mask and the count can
    never disagree (not even by the round-off of two forward layouts). Otherwise
    no forward is spent and the anchor is formed per micro-batch.
    """
    loss_cfg = strategy.ctx.loss_cfg if strategy.ctx.loss_cfg is not None else PolicyLossConfig()
    if not normalizer_needs_anchor(loss_cfg):
        return AnchorResult(logp_anchor=None, exact=False, from_theta=fn)
    with strategy.meter.time("recovery_s"):
        logp_theta = strategy.ctx.trainer.logprobs(batch)
        logp_anchor = fn(logp_theta, batch)
    return AnchorResult(logp_anchor=logp_anchor, exact=False, metrics={"recovery/forwards": 1.0})


class Interpolation(RecoveryStrategy):
    """Shared by loglinear and linear: ``interpolate`` is the anchor formula, ``cfg.convention`` its v_theta."""

    exact = False
    #: every convention the anchor can be formed with (``megarl verify-recovery`` measures each)
    conventions = CONVENTIONS
    #: ``interpolate(logp_theta, mb, convention) -> logp_prox``, set by each subclass
    interpolate: ClassVar[Callable[..., torch.Tensor]]

    def anchor_with(self, logp_theta: torch.Tensor, batch: TrainBatch, convention: Convention) -> torch.Tensor:
        """The anchor of ``batch`` under ``convention`` (whatever this strategy trains with)."""
        return self.interpolate(logp_theta, batch, convention)

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        return interpolated_anchor(self, batch, partial(self.interpolate, convention=self.cfg.convention))


@register
class Loglinear(Interpolation):
    name = "loglinear"
    Config = LoglinearConfig
    interpolate = staticmethod(loglinear_anchor)
