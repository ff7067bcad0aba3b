"""How far the engine's log-probs are from the trainer's, and what the train-inference rule does about it.

Per train batch, over the policy tokens (loss_mask = 1):

    r_d/abs_logp_mean, r_d/abs_logp_max    mean and max |logp_old - logp_behav|: the discrepancy itself,
                                           where logp_old is known (an exact anchor, or verify-recovery's
                                           forward of every token's version); log r_d per token
    behav_w/abs_log_w_max                  max |logp_anchor - logp_behav| = max |log w_t| of the anchor
                                           the loss uses (its mean is the loss's
                                           abs_logp_anchor_minus_behav_mean)
    behav_w/masked_frac                    share of policy tokens the rule masks (M_t = 0)
    behav_w/downweighted_frac              share of policy tokens kept with weight f(w_t) < 0.9
    behav_w/seq_log_w_std                  spread over sequences of the sequence-level log-weight
    behav_w/seq_w_min, behav_w/seq_w_max   (mean of log w_t over a sequence's policy tokens, the weight
                                           behav_level=sequence applies), as std and min/max of w_seq

w, M and f are those of megarl/losses/policy.py under the run's loss config, so
the shares are the ones the loss applies. With engines and trainer in fp32 on
CPU, logp_old = logp_behav to ~1e-6 and all of these stay at their no-mismatch
values (0, 0, 0 and 1); bf16 engines or MoE routing make them move.
"""
from __future__ import annotations

import torch

from megarl.losses.config import PolicyLossConfig
from megarl.losses.policy import _behav_weight_and_mask, _zero_masked

DOWNWEIGHT_BELOW = 0.9
"""A kept token counts as down-weighted when its weight f(w_t) is below this."""


def discrepancy(logp_old: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |logp_old - logp_behav| over policy tokens where both are finite (r_d/*)."""
    valid = (loss_mask != 0) & torch.isfinite(logp_old) & torch.isfinite(logp_behav)
    gap = (logp_old.float() - logp_behav.float()).abs()[valid]
    if gap.numel() == 0:
        return {}
    return {"r_d/abs_logp_mean": float(gap.mean()), "r_d/abs_logp_max": float(gap.max()),
            "r_d/n_tokens": float(gap.numel())}


def behav_weight_stats(logp_anchor: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor,
                       cfg: PolicyLossConfig) -> dict[str, float]:
    """The behav_w/* metrics of the module doc for the anchor the loss uses."""
    valid = loss_mask != 0
    n_valid = int(valid.sum())
    if n_valid == 0:
        return {}
    anchor = _zero_masked(logp_anchor.detach(), valid)
    behav = _zero_masked(logp_behav.detach(), valid)
    _, weight, keep, _, abs_log_w = _behav_weight_and_mask(anchor, behav, valid, cfg)
    log_w = torch.where(valid & torch.isfinite(anchor - behav), anchor - behav, torch.zeros_like(anchor))
    has = valid.any(-1)
    seq_log_w = (log_w.sum(-1) / valid.sum(-1).clamp(min=1))[has]
    return {"behav_w/abs_log_w_max": float(abs_log_w[valid].max()),
            "behav_w/masked_frac": float((valid & ~keep).sum()) / n_valid,
            "behav_w/downweighted_frac": float((keep & (weight < DOWNWEIGHT_BELOW)).sum()) / n_valid,
            "behav_w/seq_log_w_std": float(seq_log_w.std(unbiased=False)),
            "behav_w/seq_w_min": float(seq_log_w.exp().min()),
            "behav_w/seq_w_max": float(seq_log_w.exp().max())}
