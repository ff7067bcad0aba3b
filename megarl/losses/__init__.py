"""The policy loss shared by every old-logit recovery strategy (docs/design.md §3)."""
from megarl.losses.config import PolicyLossConfig
from megarl.losses.policy import loss_normalizer, normalizer_needs_anchor, policy_loss

__all__ = ["PolicyLossConfig", "loss_normalizer", "normalizer_needs_anchor", "policy_loss"]
