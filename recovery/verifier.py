"""Ground truth for old-logit recovery: the forward of the exact version v_t of every token.

``true_logp_old`` runs, for each version v present in the batch, a forward of
the whole batch under the parameters of v and keeps the positions of that
version: the slow, obviously-correct reference the exact strategies are
checked against (``megarl verify-recovery``). ``compare`` reports how far an
anchor is from it over the policy tokens.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megarl.types import TrainBatch
from recovery._scoring import forward, policy_mask, versions_in


def true_logp_old(batch: TrainBatch, params_by_version: dict[int, dict[str, torch.Tensor]],
                  trainer: Any) -> torch.Tensor:
    """[B, L-1]: at each policy token the log-prob under the version that generated it; NaN elsewhere."""
    mask = policy_mask(batch)
    missing = [v for v in versions_in(batch) if v not in params_by_version]
    if missing:
        raise KeyError(f"no parameters for versions {missing} (have {sorted(params_by_version)})")
    truth = torch.full(batch.loss_mask.shape, math.nan, dtype=torch.float32)
    for v in versions_in(batch):
        lp = forward(trainer, batch, params_by_version[v]).float().cpu()
        of_v = (mask & (batch.versions == v)).cpu()
        truth[of_v] = lp[of_v]
    return truth


def compare(anchor: torch.Tensor, truth: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """Errors of ``anchor`` against ``truth`` over policy tokens, and how spliced the batch is.

    A non-finite anchor at a policy token counts as an infinite error.
    """
    mask = policy_mask(batch).cpu()
    err = (anchor.detach().float().cpu() - truth.float())[mask].abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))
    versions = batch.versions.cpu()
    per_seq = [len(torch.unique(versions[b][mask[b]])) for b in range(versions.shape[0])]
    n = int(mask.sum())
    return {
        "max_abs_err": float(err.max()) if n else 0.0,
        "mean_abs_err": float(err.mean()) if n else 0.0,
        "n_tokens": float(n),
        "n_spliced_sequences": float(sum(k >= 2 for k in per_seq)),
        "max_versions_per_sequence": float(max(per_seq, default=0)),
    }
