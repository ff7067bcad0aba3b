"""What routing replay changes, measured by ``megarl verify-recovery``: route flips and r_d without replay.

A route flip is a position and MoE layer where the engine's experts differ
from those the trainer's own routers choose. Two causes are told apart:

- **numeric mismatch** (``same_version``): the trainer routes with the
  parameters of the version that generated the segment, the network the
  engine ran; a flip then comes from kernels and precision (bf16 near-ties),
  the train-inference discrepancy R3 exists for. In fp32 it is ~0.
- **version drift** (``current_weights``): the trainer routes with its current
  parameters, which moved on since; flips then add the routers' own learning
  to the mismatch. This is what a replay of stale routes in the policy forward
  departs from, not an engine defect.

Every position a segment routed counts (its prefix too: it was re-prefilled by
that request), compared with the trainer routing the same row live.
"""
from __future__ import annotations

from typing import Any

import torch

from megarl.routes import as_int16
from megarl.trainer.routing_replay import live_routes, route_disagreement
from megarl.types import TrainBatch

KINDS = ("same_version", "current_weights")


def empty_counts() -> dict[str, dict[str, float]]:
    return {k: {"n_tokens": 0.0, "tokens_differ": 0.0, "decisions": 0.0, "decisions_differ": 0.0} for k in KINDS}


def count_flips(batch: TrainBatch, params_by_version: dict[int, dict[str, torch.Tensor]], trainer: Any,
                counts: dict[str, dict[str, float]], flipped: torch.Tensor | None = None) -> dict[str, float]:
    """Add ``batch``'s flips to ``counts`` (:func:`empty_counts`); returns this batch's shares as metrics.
    ``flipped`` ([B, L-1] bool, filled in place): the flip positions, the policy tokens a segment owns whose
    input position the trainer at the segment's version routes elsewhere (recovery/_routes_matter.py)."""
    now = live_routes(trainer, batch)
    at_version: dict[tuple[int, int], torch.Tensor] = {}
    batch_counts = empty_counts()
    for b, segs in enumerate(batch.route_segments or []):
        for seg in segs:
            if seg.version not in params_by_version:
                continue
            key = (b, seg.version)
            if key not in at_version:
                with trainer.use_params(params_by_version[seg.version]):
                    at_version[key] = live_routes(trainer, batch.select([b]))[0]
            engine = torch.from_numpy(as_int16(seg.routes))[None]
            n = min(seg.end, at_version[key].shape[0])
            if flipped is not None:
                own = engine[0, :n].long().sort(-1).values != at_version[key][:n].long().sort(-1).values
                both = (engine[0, :n] >= 0).all(-1) & (at_version[key][:n] >= 0).all(-1)
                at = torch.zeros(flipped.shape[1], dtype=torch.bool)
                at[:n] = (own.any(-1) & both).any(-1)
                at[:seg.start] = False
                flipped[b] |= at & (batch.versions[b].cpu() == seg.version) & (batch.loss_mask[b].cpu() != 0)
            for kind, live in (("same_version", at_version[key][None, :n]), ("current_weights", now[b:b + 1, :n])):
                d = route_disagreement(engine[:, :n], live)
                for acc in (counts[kind], batch_counts[kind]):
                    acc["n_tokens"] += d["routes/n_tokens"]
                    acc["tokens_differ"] += d["routes/tokens_differ_frac"] * d["routes/n_tokens"]
                    acc["decisions"] += d["routes/n_decisions"]
                    acc["decisions_differ"] += d["routes/decisions_differ_frac"] * d["routes/n_decisions"]
    out = {}
    for kind, shares in summarize(batch_counts).items():
        out.update({f"routes/{kind}/{k}": v for k, v in shares.items()})
    return out


def summarize(counts: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Shares of tokens (any layer differs) and of token x layer decisions that differ, per kind."""
    return {kind: {"tokens_differ_frac": c["tokens_differ"] / max(c["n_tokens"], 1.0),
                   "decisions_differ_frac": c["decisions_differ"] / max(c["decisions"], 1.0),
                   "n_tokens": c["n_tokens"]}
            for kind, c in counts.items()}
