"""Which routes each exact strategy scores each token with, read back token by token.

Hand-made route segments differ at every position (from each other, and
from live routing), so a token scored with any routes but its own segment's
over every position it attends to (megarl/routes.py, the rule) carries a
different anchor value: :class:`route_echo.RouteEchoScorer` returns, as each
token's log-prob, a digest of the routes its forward replayed. The history
holds a sequence spliced across an update (v7 then v8, the v8 request's
prefix routes its own), a multi-turn trajectory whose two turns are two
segments of one version, a request recomputed within one version (two
segments of v8, dedicated's per-piece slicing), and a trajectory whose
engine returned no routes (live). Snapshot, interrupt_sync, dedicated (its
child process builds the same scorer) and the verifier's reference go
through it.
"""
from __future__ import annotations

import numpy as np
import pytest
from recovery_scorer import LoopState, extend, tiny_checkpoint
from route_echo import RouteEchoScorer, candidates, expected_routes, routes_used

from megarl.routes import RouteSegment, compact
from megarl.types import NO_VERSION, TrainBatch, Trajectory
from recovery import verifier
from recovery.dedicated import Dedicated, DedicatedConfig
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig

LAYERS, K = 2, 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


class _Routes:
    """Route segments whose ids differ from every other segment's at every position (and are never -1)."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, traj: Trajectory, start: int, end: int, version: int) -> None:
        t = np.arange(end)[:, None, None]
        ids = self.n * 32 + t + 4 * np.arange(LAYERS)[None, :, None] + np.arange(K)[None, None, :]
        self.n += 1
        traj.add_route_segment(RouteSegment(start, compact(ids), version))


def _publish(strategy, trainer, loop: LoopState, params: dict, interrupted: list[Trajectory]) -> None:
    """An optimizer step, the interrupt of ``interrupted``, then the publish of the new version."""
    old = loop.published
    trainer.fake_step()
    strategy.after_optimizer_step(trainer.version, {})
    strategy.on_rollout_interrupted(interrupted)
    strategy.before_publish(old, trainer.version)
    loop.published = trainer.version
    strategy.on_weights_published(trainer.version)
    params[trainer.version] = trainer.get_params()


def drive(strategy, trainer, loop: LoopState) -> tuple[TrainBatch, list[Trajectory], dict]:
    """The loop's hooks over a history with route segments (module doc); the trainer ends at version 9."""
    routes, params = _Routes(), {7: trainer.get_params()}
    loop.published = 7
    strategy.on_weights_published(7)
    t0 = extend(Trajectory("t0", "g0", [1, 5, 6], logp_old=[]), "policy", 4, 7, seed=1)
    routes.add(t0, 2, 6, 7)  # P=3: owns indices 2..5, fed positions 0..5
    t1 = extend(Trajectory("t1", "g0", [1, 7], logp_old=[]), "policy", 3, 7, seed=2)
    routes.add(t1, 1, 4, 7)  # the first turn
    extend(t1, "tool", 2, NO_VERSION, seed=3)
    extend(t1, "policy", 3, 7, seed=4)
    routes.add(t1, 6, 9, 7)  # the second turn re-prefills the whole context with routes of its own
    loop.live = [t0, t1]
    strategy.on_segment_finished(t1)
    _publish(strategy, trainer, loop, params, [t0])
    extend(t0, "policy", 6, 8, seed=5)
    routes.add(t0, 6, 12, 8)  # resubmitted under v8: its prefix routes are v8's own
    strategy.on_segment_finished(t0)
    t2 = extend(Trajectory("t2", "g1", [1, 9, 9, 9], logp_old=[]), "policy", 5, 8, seed=6)
    routes.add(t2, 3, 5, 8)  # preempted after two tokens, recomputed by the engine within v8
    routes.add(t2, 5, 8, 8)
    t3 = extend(Trajectory("t3", "g1", [1, 4, 4], logp_old=[]), "policy", 3, 8, seed=7)  # no routes: live
    loop.live += [t2, t3]
    for t in (t2, t3):
        strategy.on_segment_finished(t)
    trainer.fake_step()  # no token is of the current version: every one is scored with kept weights
    strategy.after_optimizer_step(trainer.version, {})
    trajs = [t0, t1, t2, t3]
    for t in trajs:
        t.advantage = 1.0
    return TrainBatch.from_trajectories(trajs, version=trainer.version), trajs, params


def wrong_routes(anchor, batch: TrainBatch) -> list[str]:
    """Every policy token whose anchor was not scored with its own segment's routes, named with the routes it
    was scored with; empty when all are right."""
    bad, n = [], 0
    for b, segs in enumerate(batch.route_segments):
        for i in range(batch.loss_mask.shape[1]):
            v = int(batch.versions[b, i])
            if not batch.loss_mask[b, i] or v == NO_VERSION:
                continue
            n += 1
            want, value = expected_routes(segs, v, i), float(anchor[b, i])
            if candidates(segs, i, (LAYERS, K))[want] != value:
                bad.append(f"{batch.traj_ids[b]}[{i}] v{v}: scored with {routes_used(value, segs, i, (LAYERS, K))}, "
                           f"expected {want}")
    assert n == 24, n  # every policy token was looked at
    return bad


def test_the_history_tells_routes_apart(ckpt):
    """The digests of a row's segments and of live routing differ at every owned position, so a token scored
    with any other routes than its own is seen."""
    trainer = RouteEchoScorer(ckpt, version=7)
    batch, _, _ = drive(Snapshot(SnapshotConfig(), LoopState().context(trainer)), trainer, LoopState())
    assert [len(s) for s in batch.route_segments] == [2, 2, 2, 0]
    for b, segs in enumerate(batch.route_segments):
        for i in range(batch.loss_mask.shape[1]):
            values = list(candidates(segs, i, (LAYERS, K)).values())
            assert len(set(values)) == len(values), (b, i)


def test_snapshot_scores_every_token_with_its_segments_routes(ckpt):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    strat = Snapshot(SnapshotConfig(), loop.context(trainer))
    batch, trajs, _ = drive(strat, trainer, loop)
    assert wrong_routes(strat.anchor(batch, trajs).logp_anchor, batch) == []


def test_interrupt_sync_scores_every_token_with_its_segments_routes(ckpt):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    batch, trajs, _ = drive(strat, trainer, loop)
    anchor = strat.anchor(batch, trajs)
    assert strat.overhead()["stall_scored_tokens"] == 10  # the v7 tokens, scored at the publish of v8
    assert wrong_routes(anchor.logp_anchor, batch) == []


def test_dedicated_scores_every_piece_with_its_segments_routes(ckpt, tmp_path):
    """Each piece goes to the child with its owning segment's routes up to the piece's last position."""
    cfg = DedicatedConfig(scorer_factory="route_echo:make_route_echo_scorer", start_timeout_s=120,
                          wait_timeout_s=120)
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    strat = Dedicated(cfg, loop.context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))
    try:
        batch, trajs, _ = drive(strat, trainer, loop)
        assert wrong_routes(strat.anchor(batch, trajs).logp_anchor, batch) == []
    finally:
        strat.close()


def test_the_reference_scores_every_token_with_its_segments_routes(ckpt):
    trainer, loop = RouteEchoScorer(ckpt, version=7), LoopState()
    batch, _, params = drive(Snapshot(SnapshotConfig(), loop.context(trainer)), trainer, loop)
    assert wrong_routes(verifier.true_logp_old(batch, params, trainer), batch) == []

