"""Helpers shared by the exact strategies and the verifier: per-version forwards.

Not a strategy (the registry skips modules starting with ``_``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from megarl.routes import NO_ROUTE, RouteSegment, scoring_units
from megarl.types import NO_VERSION, Segment, TrainBatch, Trajectory


def policy_mask(batch: TrainBatch) -> torch.Tensor:
    """[B, L-1] bool: tokens a policy version generated (the only ones that need old logits)."""
    return (batch.loss_mask != 0) & (batch.versions != NO_VERSION)


def versions_in(batch: TrainBatch) -> list[int]:
    """Distinct versions of the batch's policy tokens, ascending."""
    return sorted(int(v) for v in torch.unique(batch.versions[policy_mask(batch)]).tolist())


def forward(trainer: Any, batch: TrainBatch, params: dict[str, torch.Tensor] | None,
            saved: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``trainer.logprobs(batch)`` under ``params`` (None = the trainer's current params, no swap); ``saved``: a
    copy of the current params the caller holds, restored after the forward (``trainer.use_params``)."""
    if params is None:
        return trainer.logprobs(batch)
    with trainer.use_params(params, saved):
        return trainer.logprobs(batch)


def score_versions(batch: TrainBatch, trainer: Any,
                   params_of: Callable[[int], dict[str, torch.Tensor] | None],
                   out: torch.Tensor | None = None, saved: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Fill ``out`` at each policy token with its log-prob under the version that generated it.

    One forward per distinct version (:func:`score_at`), so a spliced sequence is
    scored once per segment version. ``params_of(v)`` returns the parameters of
    version v, or None when the trainer's current parameters are version v.
    Positions that are not policy tokens keep their value in ``out`` (NaN when
    ``out`` is None). ``saved``: a copy of the current params the caller holds,
    which every swap restores from (``trainer.use_params``) instead of taking one.
    """
    if out is None:
        out = torch.full(batch.loss_mask.shape, math.nan, dtype=torch.float32, device=batch.loss_mask.device)
    for v in versions_in(batch):
        score_at(batch, trainer, v, params_of(v), out, saved=saved)
    return out


def score_at(batch: TrainBatch, trainer: Any, version: int, params: dict[str, torch.Tensor] | None,
             out: torch.Tensor, wanted: torch.Tensor | None = None,
             saved: dict[str, torch.Tensor] | None = None) -> int:
    """Write into ``out`` the log-probs under ``params`` (None: the trainer's current ones) of ``batch``'s policy
    tokens of ``version`` (``wanted``: only these); returns how many. One forward over the rows holding them;
    with routing replay a row appears once per route segment of that version, replaying that segment's routes
    (megarl.routes.scoring_units: the rule of which routes a forward at a token's own version replays).
    ``saved``: as in :func:`forward`."""
    units = scoring_units(batch, version, wanted)
    if not units:
        return 0
    sub = batch.select([u.row for u in units])
    width = sub.loss_mask.shape[1]
    if batch.route_segments is not None:
        none = torch.full((width, *sub.routes.shape[2:]), NO_ROUTE, dtype=torch.int16)
        sub.routes = torch.stack([none if u.routes is None else u.routes[:width] for u in units])
    lp = forward(trainer, sub, params, saved).to(out.device, out.dtype)
    n = 0
    for j, u in enumerate(units):
        sel = u.mask[:width].to(out.device)
        out[u.row, :width][sel] = lp[j][sel]
        n += int(sel.sum())
    return n


def scoring_segments(traj: Trajectory) -> list[tuple[Segment, RouteSegment | None]]:
    """``traj.segments()`` (runs of one version), each split where the request that generated it changes: a
    piece is scored at its version replaying the routes of the route segment that owns it (None: no segment
    of that version owns it, or no routing replay; it routes live). Scoring one piece needs the routes of
    positions ``[0, len(prompt_ids) + piece.end - 1)`` (megarl.routes: the rule)."""
    p0 = len(traj.prompt_ids)
    out: list[tuple[Segment, RouteSegment | None]] = []
    for seg in traj.segments():
        cuts = []  # (response start, response end, route segment) of the route segments of this version
        for rs in traj.route_segments:
            if rs.version == seg.version:
                a, b = max(seg.start, rs.start - p0 + 1), min(seg.end, rs.end - p0 + 1)
                if a < b:
                    cuts.append((a, b, rs))
        pos = seg.start
        for a, b, rs in sorted(cuts, key=lambda c: c[0]):
            if a > pos:
                out.append((Segment(traj.traj_id, pos, a, seg.version), None))
            a = max(a, pos)
            if a < b:
                out.append((Segment(traj.traj_id, a, b, seg.version), rs))
                pos = b
        if pos < seg.end:
            out.append((Segment(traj.traj_id, pos, seg.end, seg.version), None))
    return out


def check_rows(batch: TrainBatch, trajs: list[Trajectory]) -> None:
    ids = [t.traj_id for t in trajs]
    if list(batch.traj_ids) != ids:
        raise ValueError(f"batch rows {list(batch.traj_ids)[:4]}... do not match trajectories {ids[:4]}...")


def logp_old_from_trajs(batch: TrainBatch, trajs: list[Trajectory]) -> torch.Tensor:
    """[B, L-1] tensor of the trajectories' ``logp_old`` lists in batch convention (NaN elsewhere)."""
    check_rows(batch, trajs)
    out = torch.full(batch.loss_mask.shape, math.nan, dtype=torch.float32)
    for b, t in enumerate(trajs):
        if t.logp_old is None:
            continue
        p = int(batch.prompt_lens[b])
        out[b, p - 1:p - 1 + len(t.logp_old)] = torch.tensor(t.logp_old, dtype=torch.float32)
    return out.to(batch.loss_mask.device)


def ensure_logp_old(traj: Trajectory) -> list[float]:
    """``traj.logp_old``, created as NaN at policy tokens (0.0 at tool tokens) when absent."""
    if traj.logp_old is None:
        traj.logp_old = [math.nan if m else 0.0 for m in traj.loss_mask]
    elif len(traj.logp_old) != len(traj.response_ids):
        raise ValueError(f"trajectory {traj.traj_id}: logp_old has {len(traj.logp_old)} entries "
                         f"for {len(traj.response_ids)} response tokens")
    return traj.logp_old


def unscored(traj: Trajectory) -> list[int]:
    """Response indices of policy tokens whose ``logp_old`` is not known yet."""
    old = traj.logp_old
    return [i for i, m in enumerate(traj.loss_mask)
            if m and traj.versions[i] != NO_VERSION and (old is None or math.isnan(old[i]))]


def params_nbytes(params: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in params.values())
