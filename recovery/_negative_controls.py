"""Negative controls for ``megarl verify-recovery``: deliberately wrong inputs that its checks must reject.

A check that never fails certifies nothing. ``megarl verify-recovery
--negative-control NAME`` runs the same loop with one thing made wrong on
purpose; the command must then exit 1, naming the check that caught it.

Wrong strategies (they claim exactness; the strategy check must refute it):

- ``anchor_is_behav``: the anchor is the engine's ``logp_behav``. In bf16 it
  misses the reference by r_d; in fp32 it is within tolerance and only the
  copy check (its bits equal ``logp_behav``'s) catches it.
- ``next_version``: every token is scored with the weights of the version
  after the one that sampled it (the current weights where there is none yet).

Wrong routes (every forward of the run sees them, the strategy's and the
reference's alike, so strategy and reference still agree; only the engine
oracle can see it, in fp32):

- ``routes_shifted``: every segment's routes move one position later.
- ``routes_other_version``: in a sequence spliced across versions, each
  segment takes the routes of a segment of another version.
- ``routes_first_prefix``: the prefix of each later segment keeps the routes
  of the first segment that routed it (the rule of other systems' partial
  rollouts, and megarl's before per-segment routes).

A wrong checkpoint (with ``--restart-at``, megarl/verify/exactness_restart.py):

- ``restart_wrong_version``: the kept tokens of one partial answer claim the
  version before their own in the checkpoint the run resumes from.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from megarl.routes import RouteSegment, as_int16, compact
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._scoring import score_versions
from recovery.base import DelegatingStrategy


class AnchorIsBehav(DelegatingStrategy):
    """Claims exactness and returns ``logp_behav`` as its anchor (a negative control)."""

    name = "anchor_is_behav"
    exact = True

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        self.inner.anchor(batch, trajs)  # the wrapped strategy keeps its own bookkeeping
        return AnchorResult(logp_anchor=batch.logp_behav.clone(), exact=True)


class NextVersion(DelegatingStrategy):
    """Claims exactness and scores each token with the weights of the version after its own (a negative
    control); keeps a copy of every published version for that."""

    name = "next_version"
    exact = True

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self._params: dict[int, dict] = {}

    def on_weights_published(self, version: int) -> None:
        self._params[version] = self.ctx.trainer.get_params()
        self.inner.on_weights_published(version)

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        self.inner.anchor(batch, trajs)
        logp = score_versions(batch, self.ctx.trainer, lambda v: self._params.get(v + 1))
        return AnchorResult(logp_anchor=logp, exact=True)


STRATEGY_CONTROLS = {"anchor_is_behav": AnchorIsBehav, "next_version": NextVersion}


def _replace(seg: RouteSegment, rows: np.ndarray) -> RouteSegment:
    return RouteSegment(seg.start, compact(rows), seg.version)


def routes_shifted(segments: list[RouteSegment]) -> list[RouteSegment]:
    out = []
    for seg in segments:
        rows = np.full_like(as_int16(seg.routes), -1)
        rows[1:] = as_int16(seg.routes)[:-1]
        out.append(_replace(seg, rows))
    return out


def routes_other_version(segments: list[RouteSegment]) -> list[RouteSegment]:
    out = []
    for seg in segments:
        other = next((o for o in reversed(segments) if o.version != seg.version), None)
        if other is None:
            out.append(seg)
            continue
        rows = np.full_like(as_int16(seg.routes), -1)
        n = min(seg.end, other.end)
        rows[:n] = as_int16(other.routes)[:n]
        out.append(_replace(seg, rows))
    return out


def routes_first_prefix(segments: list[RouteSegment]) -> list[RouteSegment]:
    out: list[RouteSegment] = []
    merged = None  # per position, the route of the first segment that knew it
    for seg in segments:
        rows = as_int16(seg.routes).copy()
        if merged is not None:
            n = min(len(merged), len(rows))
            first = (merged[:n] >= 0).all(-1)
            rows[:n][first] = merged[:n][first]
        merged = rows if merged is None or len(rows) >= len(merged) else np.concatenate([rows, merged[len(rows):]])
        out.append(_replace(seg, rows))
    return out


ROUTE_CONTROLS: dict[str, Callable[[list[RouteSegment]], list[RouteSegment]]] = {
    "routes_shifted": routes_shifted, "routes_other_version": routes_other_version,
    "routes_first_prefix": routes_first_prefix}

#: controls that change the checkpoint a ``--restart-at`` run resumes from (megarl/verify/exactness_restart.py does it)
RESTART_CONTROLS = ("restart_wrong_version",)

NAMES = (*STRATEGY_CONTROLS, *ROUTE_CONTROLS, *RESTART_CONTROLS)
