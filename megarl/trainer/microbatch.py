"""Split a TrainBatch into per-rank micro-batches under a token budget.

Rows are dealt to data-parallel ranks round-robin (row i -> DP rank i % dp),
sorted by length (longest first, so similar lengths share a micro-batch and
padding stays small) and packed greedily: a micro-batch takes rows while
``rows * longest_row <= micro_batch_tokens``, and always at least one row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.trainer.parallel import comm_device


@dataclass
class MicroBatch:
    """Rows ``rows`` of the full batch; ``batch`` is ``TrainBatch.select(rows)``."""

    rows: list[int]
    tokens: torch.Tensor  # [b, l], trimmed to the longest row
    batch: object | None
    #: a weight-0 filler that only keeps collectives aligned across DP ranks
    dummy: bool = False


def pack_rows(lengths: dict[int, int], budget: int) -> list[list[int]]:
    """Greedy packing of row ids (longest first) into groups with ``len(group) * max_len <= budget``."""
    order = sorted(lengths, key=lambda r: (-lengths[r], r))
    groups: list[list[int]] = []
    for r in order:
        # longest first: the group's first row sets its length
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _to(batch, device: torch.device):
    """The TrainBatch with every tensor field on ``device`` (the loss sees them next to logp_theta)."""
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v.to(device) for k, v in moved.items() if torch.is_tensor(v)})


def plan_microbatches(batch, dp_rank: int, dp: int, budget: int,
                      device: torch.device | None = None) -> list[MicroBatch]:
    """This DP rank's micro-batches; every DP rank gets the same count (collective when dp > 1)."""
    device = device or torch.device("cpu")
    rows = list(range(dp_rank, batch.size, dp))
    groups = pack_rows({r: int(batch.seq_lens[r]) for r in rows}, budget)
    mbs = []
    for g in groups:
        sub = _to(batch.select(g), device)
        mbs.append(MicroBatch(rows=g, tokens=sub.tokens, batch=sub))
    count = len(mbs)
    if dp > 1:
        from megatron.core import parallel_state as ps  # megatron: after prepare_megatron() (the trainer's)

        n = torch.tensor([count], dtype=torch.long, device=comm_device())
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        count = int(n.item())
    filler = torch.zeros(1, 2, dtype=batch.tokens.dtype, device=device)
    mbs += [MicroBatch(rows=[], tokens=filler, batch=None, dummy=True) for _ in range(count - len(mbs))]
    return mbs
