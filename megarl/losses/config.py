"""Configuration of the one policy-loss formula (docs/design.md §3)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class PolicyLossConfig:
    """Every anchor (exact ``logp_old`` or a proximal ``logp_prox``) uses this one loss."""

    eps_clip: float = 0.2
    """PPO clip: r = exp(logp_theta - logp_anchor) is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = None
    """Upper clip width; None means eps_clip (symmetric)."""
    dual_clip: float | None = None
    """Dual clip constant c > 1: for negative advantages the per-token loss is capped at c*|A|. None = off."""
    behav_weight: Literal["none", "mis", "tis", "mask"] = "none"
    """Train-inference correction with w = exp(logp_anchor - logp_behav): none, mis (mask out-of-bounds and weight by w), tis (weight by clamped w), mask (mask only)."""
    behav_low: float | None = None
    """Lower bound on w for mis/mask (None = no lower bound) and lower clamp for tis (None = 0)."""
    behav_high: float | None = None
    """Upper bound on w for mis/mask and upper clamp for tis (None = no upper bound)."""
    behav_level: Literal["token", "sequence"] = "token"
    """token: w per token; sequence: w of a sequence = exp(mean log w over its valid tokens), bounds tested per sequence."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are reduced to a scalar."""
    denominator: Literal["all", "kept"] = "all"
    """Token counts for the means: all valid tokens before masking (AReaL's choice) or only kept tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef x the policy's mean entropy over policy tokens (at the sampling temperature; summed over tokens and divided by the batch's policy-token count, whatever agg is), which keeps groups from collapsing onto one answer. > 0 computes the full-vocabulary entropy in the training forward (vocab-parallel under TP): an fp32 copy of the logits and its graph, in the train step only. 0 = off."""
    entropy_target: float | None = None
    """Adaptive entropy control (megarl/losses/entropy_control.py): the bonus's coefficient starts at entropy_coef and after every step moves by entropy_coef_step, up while the step's mean policy entropy (nats per policy token) is below this target and down while it is not, within [entropy_coef_min, entropy_coef_max]; so the bonus acts on a run whose policy collapses and fades where the entropy stays up by itself. None = the fixed entropy_coef."""
    entropy_coef_step: float = 0.0005
    """With entropy_target: how far the coefficient moves after each step."""
    entropy_coef_min: float = 0.0
    """With entropy_target: the smallest coefficient (a floor: entropy_coef_min = entropy_coef keeps a fixed bonus and adds to it only while the entropy is below the target)."""
    entropy_coef_max: float = 0.02
    """With entropy_target: the largest coefficient."""
    allow_truncated_sampling: bool = False
    """Train even when rollout.top_p < 1 or rollout.top_k > 0: logp_behav is then the log-prob under the renormalized truncated distribution, which the trainer cannot reproduce from full logits, so r_d = exp(logp_anchor - logp_behav) is biased (refused unless set)."""
