"""A scorer whose log-probs record the MoE routes each token was scored with, for route-level tests.

:class:`RouteEchoScorer` is :class:`~recovery_scorer.HFScorerForTests` (a real
tiny model: parameters, swaps, HF checkpoints, versions) whose ``logprobs``
returns, at every index t, a digest of the routes the forward replayed at
input positions ``0..t`` (the positions the token attends to; -1 rows where a
position routes live). A strategy's anchor then says, token by token, which
routes its forward used, whichever process ran it (the dedicated strategy's
child builds one too, through ``scorer_factory``). The digest is an integer
below 2**24, so float32 carries it exactly.
"""
from __future__ import annotations

import numpy as np
import torch
from recovery_scorer import HFScorerForTests

from megarl.routes import as_int16
from megarl.types import TrainBatch

_PRIME = 16_777_213  # largest prime below 2**24: every digest is an exact float32
_BASE = 1_000_003


def digests(routes: np.ndarray) -> list[int]:
    """Per position t of ``routes`` ([positions, layers, k] ints, -1 where live): the digest of rows 0..t."""
    out, h = [], 0
    for row in np.asarray(routes, dtype=np.int64).reshape(len(routes), -1):
        for x in row:
            h = (h * _BASE + int(x) + 2) % _PRIME
        out.append(h)
    return out


class RouteEchoScorer(HFScorerForTests):
    """HFScorerForTests whose log-prob at index t is minus the digest of the routes replayed at 0..t."""

    def __init__(self, *args, layers: int = 2, k: int = 2, **kw) -> None:
        super().__init__(*args, **kw)
        self.route_shape = (layers, k)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.forward_rows.append(list(batch.traj_ids))
        B, width = batch.loss_mask.shape
        if batch.routes is None:
            routes = np.full((B, width, *self.route_shape), -1, dtype=np.int16)
        else:
            routes = batch.routes.cpu().numpy()
        return torch.tensor([[-float(d) for d in digests(routes[b, :width])] for b in range(B)],
                            dtype=torch.float32)


def make_route_echo_scorer(checkpoint_dir: str, temperature: float = 1.0) -> RouteEchoScorer:
    """Factory for the dedicated strategy's child process (``scorer_factory`` option)."""
    return RouteEchoScorer(checkpoint_dir, temperature=temperature)


def candidates(segments, index: int, shape: tuple[int, int] = (2, 2)) -> dict[str, float]:
    """The anchor value of a token at batch ``index`` scored with each route segment of its row (over positions
    ``0..index``, as far as the segment knows them, live beyond), or live everywhere."""
    out = {}
    for j, s in enumerate(segments):
        rows = np.full((index + 1, *shape), -1, dtype=np.int16)
        n = min(index + 1, s.end)
        rows[:n] = as_int16(s.routes[:n])
        out[f"segment {j} (v{s.version})"] = -float(digests(rows)[index])
    out["live"] = -float(digests(np.full((index + 1, *shape), -1, dtype=np.int16))[index])
    return out


def expected_routes(segments, version: int, index: int) -> str:
    """Which routes a token at batch ``index`` of ``version`` must be scored with (megarl/routes.py, the rule):
    those of the segment of its version that owns it; live when none owns it."""
    for j, s in enumerate(segments):
        if s.version == version and s.start <= index < s.end:
            return f"segment {j} (v{s.version})"
    return "live"


def routes_used(value: float, segments, index: int, shape: tuple[int, int] = (2, 2)) -> str:
    """Which routes the anchor ``value`` of a token at batch ``index`` was scored with (``other`` when none of
    its row's segments nor live routing gives it: a mix of them, or routes of another row)."""
    return next((name for name, v in candidates(segments, index, shape).items() if v == value), "other")
