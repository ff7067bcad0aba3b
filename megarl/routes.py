"""MoE routes per segment: what an engine routed, how it is stored, and which routes each forward replays.

A **route segment** is one engine forward history of one version over one
request: the first request, each resubmit after an interrupt, each vLLM
recompute after a preemption, each agent turn. It keeps the expert ids the
engine chose for every input position it fed, ``routes[t]`` for position
``t`` (``[layers, k]``) over positions ``[0, end)``, and it made the
predictions from positions ``[start, end)``: in TrainBatch convention, index t
predicts ``tokens[t + 1]`` from ``tokens[: t + 1]``, so the segment owns the
log-probs at indices ``[start, end)``. A request of prompt length P that
generated n tokens is one segment with ``start = P - 1`` and ``end = P + n - 1``
(the last token is never fed back).

**The rule** (docs/design.md, "Which routes a forward replays"): a request
resumed under version v2 re-prefills its prefix with v2's weights and v2's own
expert choices, and every token v2 generates attends to that prefix. So

- a forward that scores a segment's tokens at the segment's own version
  (the exact strategies, the verifier's reference, the engine oracle) replays
  that segment's routes for every position it attends to
  (:func:`scoring_units`);
- the policy forward and backward under the current weights, and the anchors
  computed with them (ewma, recompute), replay the newest segment's route of
  every position (:func:`newest_routes`): no version's routes are the current
  weights' own, and the newest are those of the network that produced the
  latest tokens.

Keeping the first segment's prefix routes (the partial-rollout rule of other
systems) scores v2's tokens with a network v2 never ran: 1e-3 to 1e-2 nats
per token on second segments in fp32, where the right routes match the engine
to ~5e-7 (tests/unit/test_route_segments_splice.py).

**Storage.** Routes are numpy arrays end to end: uint8 where every expert id
is below 255 (255 marks a position without a route), else int16 (-1 marks it);
:func:`compact` picks the dtype. On the wire they are base64 ``.npy``
(:func:`encode` / :func:`decode`), as vLLM's native routed-experts output.
Consecutive segments of one version whose routes agree on every position they
share are one segment (:func:`append_segment`): the earlier tokens' routes
are the later request's, so one copy serves both. Segments of different
versions keep a copy each (their prefixes differ where the routers moved).
"""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

#: a position without a route in a torch routes tensor (megarl/trainer/routing_replay.py: routed live)
NO_ROUTE = -1
_UINT8_NONE = 255


@dataclass
class RouteSegment:
    """Routes one engine forward history used (module doc): positions ``[0, end)``, owning ``[start, end)``."""

    #: first input position whose prediction this history made (TrainBatch index of its first log-prob)
    start: int
    #: ``[end, layers, k]`` expert ids per input position (uint8 with 255 / int16 with -1 where none)
    routes: Any
    #: the version that generated the segment's tokens (set when it joins a trajectory)
    version: int = -1

    @property
    def end(self) -> int:
        return int(len(self.routes))

    @property
    def nbytes(self) -> int:
        return int(self.routes.nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "version": self.version, "routes": encode(self.routes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RouteSegment":
        routes = d["routes"]
        return cls(int(d["start"]), decode(routes) if isinstance(routes, dict) else compact(routes),
                   int(d.get("version", -1)))


# -- storage ----------------------------------------------------------------------------------
def compact(rows) -> np.ndarray:
    """``rows`` ([positions, layers, k] ints, negative where none) in the smallest dtype that holds them. A
    uint8 array is taken as compact already (255 = none): convert raw uint8 expert ids (vLLM's native output,
    where 255 is an expert of a 256-expert model) to a wider int first."""
    a = np.asarray(rows)
    if a.dtype == np.uint8:  # already compact (255 = none); raw engine ids arrive as wider ints
        return a
    a = a.astype(np.int64, copy=False)
    if a.size == 0 or a.max() < _UINT8_NONE:
        return np.where(a < 0, _UINT8_NONE, a).astype(np.uint8)
    return np.where(a < 0, NO_ROUTE, a).astype(np.int16)


def known(rows: np.ndarray) -> np.ndarray:
    """[positions, layers] bool: where ``rows`` hold a route."""
    none = _UINT8_NONE if rows.dtype == np.uint8 else NO_ROUTE
    return (rows != none).all(-1)


def as_int16(rows: np.ndarray) -> np.ndarray:
    """``rows`` as int16 with -1 where none (the trainer's convention)."""
    out = rows.astype(np.int16)
    out[~known(rows)] = NO_ROUTE
    return out


def encode(rows: np.ndarray) -> dict[str, str]:
    """``rows`` as base64 ``.npy`` for JSON."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(rows), allow_pickle=False)
    return {"npy_b64": base64.b64encode(buf.getvalue()).decode("ascii")}


def decode(d: dict[str, str]) -> np.ndarray:
    return compact(np.load(io.BytesIO(base64.b64decode(d["npy_b64"])), allow_pickle=False))


# -- engine side --------------------------------------------------------------------------------
def request_segments(histories: list[tuple[int, np.ndarray]], prompt_len: int, n_output: int) -> list[RouteSegment]:
    """The route segments of one request from its forward histories ``(first owned position, rows)``, in order
    (one per request unless the engine recomputed it); the first owns from the last prompt position on. Rows
    past the last output token's position (an aborted request whose final step fed a token and dropped what it
    sampled) are cut: the resubmission predicts from there. Histories that predicted no output are left out."""
    fed = prompt_len + n_output - 1
    out = []
    for i, (first, rows) in enumerate(histories):
        start = prompt_len - 1 if i == 0 else first
        seg = RouteSegment(start, compact(np.asarray(rows)[:fed]))
        if seg.end > start:
            out.append(seg)
    return out


# -- trajectory side ----------------------------------------------------------------------------
def append_segment(segments: list[RouteSegment], seg: RouteSegment) -> None:
    """Add ``seg`` after ``segments`` (in place). It merges into the last one when both are of one version,
    it reaches at least as far, and their routes agree wherever both know a position: the earlier tokens then
    replay the later request's routes, which are their own."""
    if segments:
        last = segments[-1]
        if last.version == seg.version and seg.end >= last.end and seg.start >= last.start:
            a, b = as_int16(last.routes), as_int16(seg.routes[:last.end])
            both = known(last.routes) & known(seg.routes[:last.end])
            if np.array_equal(a[both], b[both]) and not (known(last.routes) & ~known(seg.routes[:last.end])).any():
                segments[-1] = RouteSegment(last.start, seg.routes, seg.version)
                return
    segments.append(seg)


def stored_bytes(segments: list[RouteSegment]) -> int:
    return sum(s.nbytes for s in segments)


# -- which routes a forward replays (the rule, module doc) ---------------------------------------
def _shape(rows_of_batch) -> tuple[int, int] | None:
    return next((tuple(s.routes.shape[1:]) for segs in rows_of_batch or [] for s in segs), None)


def newest_routes(segments_per_row: list[list[RouteSegment]] | None, width: int):
    """[B, width, layers, k] int16 torch tensor: per input position the route of the newest segment that knows
    it, -1 where none does (the policy forward's routes); None when no row has routes."""
    import torch  # lazy: this module also serves light processes (the HTTP client, the CLI)

    shape = _shape(segments_per_row)
    if shape is None:
        return None
    out = np.full((len(segments_per_row), width, *shape), NO_ROUTE, dtype=np.int16)
    for b, segs in enumerate(segments_per_row):
        for s in segs:  # oldest first: a newer segment overwrites what it knows
            n = min(s.end, width)
            rows, k = as_int16(s.routes[:n]), known(s.routes[:n])
            out[b, :n][k] = rows[k]
    return torch.from_numpy(out)


@dataclass
class ScoringUnit:
    """One row of a forward at one version: batch row ``row``, replaying ``routes`` ([width, layers, k] int16
    torch tensor; None: live), whose log-probs are kept where ``mask`` ([width] bool) is set."""

    row: int
    mask: Any
    routes: Any | None


def scoring_units(batch, version: int, wanted=None) -> list[ScoringUnit]:
    """The forwards' rows that score ``batch``'s policy tokens of ``version`` (``wanted`` [B, L-1] bool:
    of those, only these) at that version: per row, one unit per segment of that version with its own routes;
    tokens no segment of that version owns (an engine that returned no routes) route live."""
    import torch

    of_v = (batch.loss_mask != 0) & (batch.versions == version)
    if wanted is not None:
        of_v = of_v & wanted
    width = of_v.shape[1]
    units = []
    for b in of_v.any(dim=1).nonzero().flatten().tolist():
        left = of_v[b].clone()
        for s in (batch.route_segments[b] if batch.route_segments is not None else []):
            if s.version != version:
                continue
            owned = torch.zeros(width, dtype=torch.bool)
            owned[s.start:min(s.end, width)] = True
            mask = left & owned
            if not mask.any():
                continue
            routes = torch.full((width, *s.routes.shape[1:]), NO_ROUTE, dtype=torch.int16)
            n = min(s.end, width)
            routes[:n] = torch.from_numpy(as_int16(s.routes[:n]))
            units.append(ScoringUnit(b, mask, routes))
            left &= ~owned
        if left.any():
            units.append(ScoringUnit(b, left, None))
    return units
