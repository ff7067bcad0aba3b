"""Split a TrainBatch into this DP rank's micro-batches under a token budget.

The plan is megarl/trainer/packing.py's: every rank computes the same plan from the row lengths
(first-fit-decreasing under ``micro_batch_tokens``, the count a multiple of dp, Karmarkar-Karp over
DP ranks on a compute estimate) and takes its own share, so no collective is needed and every DP
rank runs the same number of micro-batches. The padded layout runs each micro-batch as a
rectangle trimmed to its longest row (rows x longest <= micro_batch_tokens unless one row alone is
longer).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.trainer.packing import DEFAULT_LINEAR_WEIGHT, plan_packing


@dataclass
class MicroBatch:
    """Rows ``rows`` of the full batch; ``batch`` is ``TrainBatch.select(rows)``."""

    rows: list[int]
    tokens: torch.Tensor  # [b, l], trimmed to the longest row
    batch: object | None
    #: a weight-0 filler that only keeps collectives aligned across DP ranks
    dummy: bool = False


def _to(batch, device: torch.device):
    """The TrainBatch with every tensor field on ``device`` (the loss sees them next to logp_theta)."""
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v.to(device) for k, v in moved.items() if torch.is_tensor(v)})


def microbatches_of(batch, groups: list[list[int]], device: torch.device | None = None) -> list[MicroBatch]:
    """The micro-batches of one DP rank's share of a plan (lists of row ids; an empty list is a dummy)."""
    device = device or torch.device("cpu")
    filler = torch.zeros(1, 2, dtype=batch.tokens.dtype, device=device)
    mbs = []
    for g in groups:
        if not g:
            mbs.append(MicroBatch(rows=[], tokens=filler, batch=None, dummy=True))
            continue
        sub = _to(batch.select(g), device)
        mbs.append(MicroBatch(rows=g, tokens=sub.tokens, batch=sub))
    return mbs


def plan_microbatches(batch, dp_rank: int, dp: int, budget: int, device: torch.device | None = None, *,
                      layout: str = "padded", linear_weight: int = DEFAULT_LINEAR_WEIGHT) -> list[MicroBatch]:
    """This DP rank's micro-batches under the shared plan (module doc); the same count on every DP rank."""
    plan = plan_packing([int(n) for n in batch.seq_lens], dp, budget, layout=layout, linear_weight=linear_weight)
    return microbatches_of(batch, plan.ranks[dp_rank], device)
