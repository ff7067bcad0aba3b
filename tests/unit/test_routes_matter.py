"""The checks where routing replay matters: replay vs live at the flip positions, the anchor's route ids, and
the policy forward's routes (recovery/_routes_matter.py), on the hand-made history of
test_route_level_scoring.py.

:class:`route_echo.RouteEchoScorer` computes no expert choice of its own: its live routing is the ``-1`` rows.
Its routers' choice, as ``megarl verify-recovery`` measures it (``live_routes``), is taken here as an expert id
no segment uses, so every policy token a segment owns is a flip position (21 of the 24: t3's engine returned no routes).
"""
from __future__ import annotations

import copy

import pytest
import torch
from recovery_scorer import LoopState, tiny_checkpoint
from route_echo import RouteEchoScorer, candidates, expected_routes
from test_route_level_scoring import LAYERS, K, drive

from megarl.routes import newest_routes
from megarl.types import NO_VERSION, AnchorResult, TrainBatch, Trajectory
from megarl.verify.exactness import failures
from recovery import _route_checks
from recovery._negative_controls import routes_shifted
from recovery._routes_matter import empty, judge, policy_routes_wrong, summary
from recovery.base import DelegatingStrategy
from recovery.dedicated import Dedicated, DedicatedConfig
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig
from recovery.verifier import VerifyingStrategy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def routers_choose_elsewhere(monkeypatch):
    def live_routes(trainer, batch):
        B, L = batch.tokens.shape
        return torch.full((B, L - 1, LAYERS, K), 250, dtype=torch.int16)

    monkeypatch.setattr(_route_checks, "live_routes", live_routes)


def _engine_close(batch: TrainBatch) -> None:
    """``logp_behav``: the right routes' value, off by a bf16-sized 1e-3 (an engine that computes the same
    network in another precision)."""
    for b, segs in enumerate(batch.route_segments):
        for i in range(batch.loss_mask.shape[1]):
            v = int(batch.versions[b, i])
            if batch.loss_mask[b, i] and v != NO_VERSION:
                batch.logp_behav[b, i] = candidates(segs, i, (LAYERS, K))[expected_routes(segs, v, i)] + 1e-3


def _verified(ckpt, make, wrap=None, run_dir=""):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    inner = make(loop.context(trainer, run_dir=run_dir, checkpoint_dir=ckpt))
    wrapped = VerifyingStrategy(inner if wrap is None else wrap(inner))
    try:
        batch, trajs, _ = drive(wrapped, trainer, loop)
        _engine_close(batch)
        wrapped.anchor(batch, trajs)
    finally:
        wrapped.close()
    return wrapped.report(tol=1.0)  # the echo's values are digests: only the route checks are looked at here


DEDICATED = DedicatedConfig(scorer_factory="route_echo:make_route_echo_scorer", start_timeout_s=120,
                            wait_timeout_s=120)


@pytest.mark.parametrize("make", [lambda ctx: Snapshot(SnapshotConfig(), ctx),
                                  lambda ctx: InterruptSync(InterruptSyncConfig(), ctx),
                                  lambda ctx: Dedicated(DEDICATED, ctx)],
                         ids=["snapshot", "interrupt_sync", "dedicated"])
def test_replay_is_closer_and_the_anchor_used_the_engines_routes(ckpt, routers_choose_elsewhere, make, tmp_path):
    """snapshot's and interrupt_sync's forwards run on the trainer (the verifier's tap sees them); dedicated's
    scorer reports the routes it replayed at each token."""
    rep = _verified(ckpt, make, run_dir=tmp_path)
    m = rep["routes_matter"]
    assert m["n_flip_positions"] == 21 and m["n_replay_closer"] == 21 and m["passed"], m
    assert m["anchor_engine_routes"] == 21 and m["anchor_other_routes"] == 0 == m["anchor_unseen"], m
    assert rep["routes"]["policy_routes_wrong"] == 0
    assert failures({"strategies": {"s": rep}}) == []


class _ScoresLive(DelegatingStrategy):
    """Claims exactness and scores every token at its version with live routes (the inner strategy on a copy of
    the batch without routes)."""

    name = "scores_live"
    exact = True

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        unrouted = copy.deepcopy(batch)
        unrouted.routes, unrouted.route_segments = None, None
        return self.inner.anchor(unrouted, trajs)


def test_an_anchor_scored_with_live_routes_fails_by_its_route_ids(ckpt, routers_choose_elsewhere):
    rep = _verified(ckpt, lambda ctx: Snapshot(SnapshotConfig(), ctx), _ScoresLive)
    m = rep["routes_matter"]
    assert m["anchor_other_routes"] == 21 and m["passed"] is False, m
    lines = failures({"strategies": {"s": rep}})  # its log-probs miss the truth too: two lines
    assert any("anchor was computed with other routes than the engine's at 21 of the 21 policy tokens whose "
               "routes were compared by id" in x for x in lines), lines


def test_a_reference_that_does_not_replay_fails_replay_vs_live(ckpt, routers_choose_elsewhere):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    batch, _, _ = drive(Snapshot(SnapshotConfig(), loop.context(trainer)), trainer, loop)
    behav = batch.logp_behav
    flipped = torch.zeros(batch.loss_mask.shape, dtype=torch.bool)
    flipped[0, 3] = flipped[2, 5] = True

    def judged(replayed, live):
        counts = empty()
        judge(counts, flipped, batch, replayed, live, behav, None)
        return summary(counts)

    off = torch.where(flipped, 1.0, 0.0)
    # a "replayed" reference that is the live one: never closer, in no position and not in sum
    m = judged(behav + off, behav + off)
    assert m["n_flip_positions"] == 2 and m["n_replay_closer"] == 0 and m["passed"] is False, m
    (line,) = failures({"strategies": {"s": {"claims_exact": False, "routes_matter": m}}})
    assert "(mean gap 1 replayed, 1 live)" in line, line
    # one decided position where live routing is closer fails, even when the sum is closer
    replayed = behav.clone()
    replayed[2, 5] += 1.5
    m = judged(replayed, behav + off)
    assert m["n_replay_closer"] == 1 and m["n_undecided"] == 0 and m["passed"] is False, m
    # a flip that moves the log-prob less than the engine's discrepancy where routes agree decides nothing
    noisy = behav.clone()
    noisy[1, 2] += 0.1  # the engine's bf16 round-off on a token whose routes agree
    noisy[2, 5] += 0.06  # live is 0.05 from the replayed value: closer, but within that round-off
    live = behav + off
    live[2, 5] = behav[2, 5] + 0.01
    m = judged(noisy, live)
    assert m["n_undecided"] == 1 and m["n_replay_closer"] == 1 and m["passed"], m
    assert summary(empty())["passed"] is None  # no flip position: nothing to judge


def test_a_policy_forward_replaying_the_oldest_segments_routes_is_seen(ckpt):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    batch, _, _ = drive(Snapshot(SnapshotConfig(), loop.context(trainer)), trainer, loop)
    assert policy_routes_wrong(batch) == 0
    oldest = newest_routes([list(reversed(s)) for s in batch.route_segments], batch.routes.shape[1])
    batch.routes = oldest
    # t0: positions 0..5 (v7's request against v8's); t1: 0..3; t2: 0..4
    assert policy_routes_wrong(batch) == 6 + 4 + 5
    (line,) = failures({"strategies": {"s": {"claims_exact": False, "routes": {"policy_routes_wrong": 15}}}})
    assert "the policy forward replays other routes than the newest segment's at 15 positions" in line


class _ScoresThenRewritesTheBatch(DelegatingStrategy):
    """A right anchor from a strategy that afterwards shifts the batch's routes and changes its versions."""

    name = "rewrites_the_batch"
    exact = True

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        result = self.inner.anchor(batch, trajs)
        batch.route_segments = [routes_shifted(segs) for segs in batch.route_segments]
        batch.versions[batch.versions == 7] = 8
        return result


def test_the_reference_is_computed_from_the_batch_as_it_was_before_the_strategy_ran(ckpt, routers_choose_elsewhere):
    """What a strategy does to the batch cannot reach the truth: a right anchor stays exact."""
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    wrapped = VerifyingStrategy(_ScoresThenRewritesTheBatch(Snapshot(SnapshotConfig(), loop.context(trainer))))
    batch, trajs, _ = drive(wrapped, trainer, loop)
    wrapped.anchor(batch, trajs)
    rep = wrapped.report()
    assert rep["measured_exact"] and rep["max_abs_err"] == 0.0 and rep["n_tokens"] == 24, rep
