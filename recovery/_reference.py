"""The reference ``logp_old`` and the engine oracle that checks it (``megarl verify-recovery``).

:func:`true_logp_old` is the slow, obviously correct reference the strategies
are compared with: one forward per row and per route segment, under the
parameters of the version that generated the segment's tokens, replaying
that segment's routes (megarl/routes.py), keeping only the tokens the segment
generated. It shares no code with the strategies' scoring
(``recovery._scoring``), only the trainer's forward and the engine's routes.

A reference computed by the trainer can still be wrong in the same way as a
strategy (wrong routes, wrong version, wrong token alignment): both would
agree and the comparison would pass. :func:`engine_oracle` checks the
reference against something that shares nothing with it, the engine: with
engines and trainer in fp32 they compute the same network, so every policy
token's reference log-prob equals the engine's ``logp_behav`` to ~1e-6
(``ORACLE_TOL``). In bf16 (or with a sampling rule the trainer does not model:
top-p / top-k) the two differ by the train-inference discrepancy r_d, which
the oracle reports instead of judging.

:func:`copy_share` catches an anchor that is a copy of ``logp_behav`` rather
than a forward: in fp32 such an anchor is within tolerance of the truth, so
only its bits give it away. A forward of the trainer equals the engine's
log-prob bit for bit on many tokens (64-70% in fp32 on the tiny MoE), so the
tokens that tell are those where the reference differs from ``logp_behav`` in
any bit: a forward agrees with the reference there, a copy with the engine.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from megarl.routes import NO_ROUTE, as_int16
from megarl.types import NO_VERSION, TrainBatch

#: largest |reference - logp_behav| an fp32 engine and an fp32 trainer may differ by (observed: <= 1e-6)
ORACLE_TOL = 1e-5


def policy_tokens(batch: TrainBatch) -> torch.Tensor:
    """[B, L-1] bool on the CPU: the tokens a policy version generated (the verifier's own rule, not the
    strategies' ``recovery._scoring.policy_mask``)."""
    return ((batch.loss_mask != 0) & (batch.versions != NO_VERSION)).cpu()


def _pieces(batch: TrainBatch, b: int, replay: bool) -> list[tuple[int, torch.Tensor, Any]]:
    """(version, owned mask [L-1], routes [L-1, layers, k] or None) of row ``b``: one per route segment, and one
    per version for the row's tokens no segment owns (routed live)."""
    width = batch.loss_mask.shape[1]
    policy = policy_tokens(batch)[b]
    versions = batch.versions[b].cpu()
    left = policy.clone()
    out = []
    for seg in (batch.route_segments[b] if replay and batch.route_segments is not None else []):
        owned = torch.zeros(width, dtype=torch.bool)
        owned[seg.start:min(seg.end, width)] = True
        owned &= left & (versions == seg.version)
        if not owned.any():
            continue
        routes = torch.full((width, *seg.routes.shape[1:]), NO_ROUTE, dtype=torch.int16)
        n = min(seg.end, width)
        routes[:n] = torch.from_numpy(as_int16(seg.routes[:n]))
        out.append((seg.version, owned, routes))
        left &= ~owned
    for v in sorted(set(versions[left].tolist())):
        out.append((int(v), left & (versions == v), None))
    return out


def true_logp_old(batch: TrainBatch, params_by_version: dict[int, dict[str, torch.Tensor]], trainer: Any,
                  *, replay: bool = True) -> torch.Tensor:
    """[B, L-1]: each policy token's log-prob under the version that generated it, replaying the routes of the
    request that generated it (``replay=False``: every router routes live); NaN elsewhere. One forward per
    version, over one row per (row, piece) of that version."""
    truth = torch.full(batch.loss_mask.shape, math.nan, dtype=torch.float32)
    by_version: dict[int, list[tuple[int, torch.Tensor, Any]]] = {}
    for b in range(batch.size):
        for version, owned, routes in _pieces(batch, b, replay):
            by_version.setdefault(version, []).append((b, owned, routes))
    for version, pieces in sorted(by_version.items()):
        if version not in params_by_version:
            raise KeyError(f"no parameters for version {version} (have {sorted(params_by_version)})")
        rows = batch.select([b for b, _, _ in pieces])
        width = rows.loss_mask.shape[1]
        if batch.routes is not None:
            live = torch.full(rows.routes.shape[1:], NO_ROUTE, dtype=torch.int16)
            rows.routes = torch.stack([live if r is None else r[:width] for _, _, r in pieces])
        with trainer.use_params(params_by_version[version]):
            lp = trainer.logprobs(rows).float().cpu()
        for j, (b, owned, _) in enumerate(pieces):
            sel = owned[:width]
            truth[b, :width][sel] = lp[j][sel]
    return truth


def engine_oracle(truth: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """|reference - logp_behav| over the policy tokens: max, sum and count (judged by the caller)."""
    mask = policy_tokens(batch)
    gap = (truth - batch.logp_behav.float().cpu())[mask].abs()
    gap = torch.where(torch.isfinite(gap), gap, torch.full_like(gap, math.inf))
    return {"max": float(gap.max()) if gap.numel() else 0.0, "sum": float(gap.sum()), "n": float(gap.numel())}


def copy_share(anchor: torch.Tensor, truth: torch.Tensor, batch: TrainBatch) -> tuple[float, float]:
    """(copied, telling): of the policy tokens whose reference differs from ``logp_behav`` in any bit (the
    ``telling`` ones: on the others a copy and a forward look alike), how many carry ``logp_behav``'s exact
    bits in ``anchor``."""
    mask = policy_tokens(batch)
    behav = batch.logp_behav.float().cpu()[mask]
    telling = truth.float().cpu()[mask] != behav
    copied = (anchor.detach().float().cpu()[mask] == behav) & telling
    return float(copied.sum()), float(telling.sum())
