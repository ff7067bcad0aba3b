"""Stochastic rounding of fp32 values to bf16: an accumulator kept in bf16 without losing small increments.

Round-to-nearest drops every increment below half a bf16 unit in the last
place (2^-9 relative): an average updated as ``phi <- keep*phi + take*theta``
stops moving once ``take * |theta - phi|`` falls under it, and stays up to
``0.5 / take`` units behind theta for good. Rounding up with probability equal
to the discarded fraction (Gupta et al., "Deep Learning with Limited Numerical
Precision", 2015) makes the rounded value exact in expectation, so the average
keeps following theta; its spread is about one unit (ulp) at an EWMA's usual decays.

The noise comes from a ``torch.Generator`` the caller seeds, so two replicas of
one shard that fold the same values with the same seed round identically.
Not a strategy (the registry skips modules starting with ``_``).
"""
from __future__ import annotations

import torch

#: the low 16 bits of an fp32 word are what bf16 drops
_LOW_BITS = 1 << 16
_KEEP_HIGH = -_LOW_BITS  # 0xFFFF0000 as an int32


def round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: up in magnitude with probability the fraction of a bf16
    unit it drops. Adding a uniform draw in [0, 2^16) to the fp32 word and cutting its low 16 bits does
    exactly that, for either sign (the magnitude sits in the word's low 31 bits)."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16 takes fp32 values, got {x.dtype}")
    noise = torch.randint(0, _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    word = x.contiguous().view(torch.int32) + noise  # wraps like the unsigned word would
    return (word & _KEEP_HIGH).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def fold_seed(seed: int, step: int) -> int:
    """A generator seed per (run seed, fold step): replicas agree, successive folds draw anew."""
    return (seed * 1_000_003 + step) % (1 << 63)
