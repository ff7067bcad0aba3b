"""The policy loss shared by every old-logit recovery strategy (docs/design.md §3).

The formula is in :mod:`megarl.losses.policy` (torch), its settings in
:mod:`megarl.losses.config`, which the config schema imports: this package
itself stays free of torch.
"""
from megarl.losses.config import PolicyLossConfig

__all__ = ["PolicyLossConfig"]
