"""Where routing replay matters, judged by ``megarl verify-recovery`` in bf16 (and any engine precision).

In fp32 the trainer's routers at a token's own version choose the engine's
experts everywhere, so a forward that forgot to replay routes computes the
same log-probs as one that replayed them: the engine oracle cannot see
replay at all. The positions that tell are the **flip positions**: policy
tokens whose input position the trainer's own routers, at the token's
version, route to other experts than the engine did (any MoE layer;
recovery/_route_checks.py finds them). Two checks run on them:

- **replay vs live**: the reference with the engine's routes replayed must be
  closer to the engine's ``logp_behav`` than the same forward routed live, at
  every flip position where the two forwards differ by more than the engine's
  own discrepancy on the batch's other tokens (r_d where the routes agree: a
  flip that moves the log-prob less than that cannot be told from bf16
  round-off; such positions are counted as ``n_undecided``), and in sum over
  all flip positions. A reference (or a trainer) that does not really replay
  fails here.
- **anchor routes**: the anchor of an exact strategy must have been computed
  with the engine's routes, compared as route ids, not log-probs: at the
  flip positions and at every other policy token a segment owns (a wrong
  route that happens to agree with live routing is still wrong).
  :class:`RouteTap` records every forward the trainer runs for the strategy
  (its rows, the routes replayed, the log-probs out); the forward that
  produced a token's anchor value (bit for bit) tells which routes it used,
  at every position up to the token's. Forwards in another process (the
  dedicated strategy's scorer) report the routes they replayed at the
  tokens' own positions (``RecoveryStrategy.replayed_routes``); a token
  neither shows counts as ``unseen``. The route-level unit tests
  (tests/unit/test_route_level_scoring.py) check every position of every
  strategy's forwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch

from megarl.routes import as_int16, known
from megarl.types import TrainBatch
from recovery._reference import policy_tokens


def empty() -> dict[str, float]:
    return {"n_flip_positions": 0.0, "n_replay_closer": 0.0, "n_undecided": 0.0, "gap_replay_sum": 0.0,
            "gap_live_sum": 0.0,
            "anchor_engine_routes": 0.0, "anchor_other_routes": 0.0, "anchor_unseen": 0.0}


class RouteTap:
    """Records the rows, replayed routes and log-probs of every ``trainer.logprobs`` call while not paused.

    It wraps the trainer instance's ``logprobs`` (a measurement of ``megarl verify-recovery``, which owns the
    run's trainer for its duration); :meth:`paused` keeps the verifier's own forwards out of the record."""

    def __init__(self, trainer: Any) -> None:
        #: traj_id -> (log-probs, routes replayed or None: every position live) of each recorded forward row
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._on = True
        inner = trainer.logprobs

        def logprobs(batch: TrainBatch, *args, **kw):
            out = inner(batch, *args, **kw)
            if self._on:
                lp = out.detach().float().cpu()
                routes = None if batch.routes is None else batch.routes.cpu()
                for j, traj_id in enumerate(batch.traj_ids):
                    self.rows.setdefault(traj_id, []).append((lp[j], None if routes is None else routes[j]))
            return out

        trainer.logprobs = logprobs

    @contextmanager
    def paused(self):
        self._on = False
        try:
            yield
        finally:
            self._on = True

    def forget(self, traj_ids: list[str]) -> None:
        for t in traj_ids:
            self.rows.pop(t, None)

    def routes_of(self, traj_id: str, index: int, value: float) -> list[torch.Tensor | None]:
        """The routes ([index + 1, layers, k]; None: routed live) of every recorded forward of ``traj_id`` whose
        log-prob at ``index`` is ``value`` bit for bit."""
        return [None if routes is None else routes[:index + 1] for lp, routes in self.rows.get(traj_id, [])
                if index < lp.shape[0] and float(lp[index]) == value]


def _owner(segments, version: int, index: int):
    return next((s for s in segments if s.version == version and s.start <= index < s.end), None)


def _engine_routes(routes: torch.Tensor | None, seg, first: int, index: int) -> bool:
    """Whether ``routes`` (a forward's at positions ``first..index``; None: live) are the segment's at every
    one of them the segment routed, as expert sets."""
    if routes is None:
        return False
    n = min(index + 1, seg.end)
    want = torch.from_numpy(as_int16(seg.routes[first:n])).long()
    mask = torch.from_numpy(known(seg.routes[first:n]))
    got = routes[:n - first].long()
    return bool((want.sort(-1).values == got.sort(-1).values).all(-1)[mask].all())


def judge(counts: dict[str, float], flipped: torch.Tensor, batch: TrainBatch, truth: torch.Tensor,
          no_replay: torch.Tensor, anchor: torch.Tensor, tap: RouteTap | None,
          remote: Callable[[str, int], Any] | None = None) -> None:
    """Add ``batch``'s flip positions (``flipped`` [B, L-1] bool) to ``counts`` (:func:`empty`): replay vs live
    against ``logp_behav``; and which routes the anchor was computed with at every policy token a segment owns
    (``tap``: None, not looked at; ``remote(traj_id, index)``: the routes a forward in another process replayed
    at the token's own position, the strategy's ``replayed_routes``)."""
    behav = batch.logp_behav.float().cpu()
    anchor = anchor.detach().float().cpu()
    gap_replay = (truth - behav).abs()
    gap_live = (no_replay - behav).abs()
    policy = policy_tokens(batch)
    agree = policy & ~flipped & torch.isfinite(gap_replay)
    noise = float(gap_replay[agree].max()) if agree.any() else 0.0
    for b, i in flipped.nonzero().tolist():
        counts["n_flip_positions"] += 1
        if abs(float(truth[b, i]) - float(no_replay[b, i])) <= noise:
            counts["n_undecided"] += 1
        else:
            counts["n_replay_closer"] += float(gap_replay[b, i] < gap_live[b, i])
        counts["gap_replay_sum"] += float(gap_replay[b, i])
        counts["gap_live_sum"] += float(gap_live[b, i])
    if tap is None:
        return
    for b, i in policy.nonzero().tolist():
        seg = _owner(batch.route_segments[b], int(batch.versions[b, i]), i)
        if seg is None:  # no segment of its version: it routes live by the rule
            continue
        used = tap.routes_of(batch.traj_ids[b], i, float(anchor[b, i]))
        if used:
            right = any(_engine_routes(r, seg, 0, i) for r in used)
        else:
            there = None if remote is None else remote(batch.traj_ids[b], i)
            right = None if there is None else _engine_routes(torch.as_tensor(there)[None].long(), seg, i, i)
        key = {None: "anchor_unseen", True: "anchor_engine_routes", False: "anchor_other_routes"}[right]
        counts[key] += 1


def summary(counts: dict[str, float]) -> dict[str, Any]:
    """The report's ``routes_matter``; ``passed`` (None when there was nothing to judge): replay was closer at
    every decided flip position and in sum, and no anchor token compared by id used other routes than the
    engine's."""
    n = counts["n_flip_positions"]
    rep: dict[str, Any] = {k: v for k, v in counts.items() if not k.endswith("_sum")}
    rep["gap_replay_mean"] = counts["gap_replay_sum"] / max(n, 1.0)
    rep["gap_live_mean"] = counts["gap_live_sum"] / max(n, 1.0)
    checks = []
    if n:
        checks.append(counts["n_replay_closer"] == n - counts["n_undecided"]
                      and counts["gap_replay_sum"] < counts["gap_live_sum"])
    if counts["anchor_engine_routes"] + counts["anchor_other_routes"]:
        checks.append(counts["anchor_other_routes"] == 0)
    rep["passed"] = all(checks) if checks else None
    return rep


def policy_routes_wrong(batch: TrainBatch) -> int:
    """Positions where the routes the policy forward replays (``batch.routes``) are not those of the newest
    segment that routed the position (megarl/routes.py, the rule), compared as expert sets."""
    if batch.routes is None:
        return 0
    routes = batch.routes.cpu().long().sort(-1).values
    wrong = 0
    for b, segs in enumerate(batch.route_segments or []):
        for t in range(routes.shape[1]):
            newest = next((s for s in reversed(segs) if t < s.end and known(s.routes[t:t + 1]).all()), None)
            if newest is None:
                wrong += int((routes[b, t] >= 0).any())
                continue
            want = torch.from_numpy(as_int16(newest.routes[t])).long().sort(-1).values
            wrong += int(not torch.equal(want, routes[b, t]))
    return wrong
