"""The loop's multi-rank path with routing replay: rank 0 drives, rank 1 follows (megarl/loop/spmd.py).

Used by tests/distributed/run_parallel.py (mode ``ep2_loop_replay``). Rank 0 turns the fixed batch with
its hand-built routes into trajectories and calls a scoring strategy's ``anchor`` (the followers rebuild
the batch from the trajectories sent), the train step, and ``after_optimizer_step`` (the followers score
the live trajectories sent with the hook; half of them unfinished, so sent as frozen copies). Every
forward is a collective: a rank without routes would route its rows live and change the log-probs.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.routes import RouteSegment, compact
from megarl.types import AnchorResult, TrainBatch, Trajectory


def trajectories(batch) -> list[Trajectory]:
    """The rows of ``batch`` as trajectories of a one-token prompt, so every prediction is a policy token."""
    out = []
    for b in range(batch.size):
        n = int(batch.seq_lens[b])
        ids = batch.tokens[b, :n].tolist()
        out.append(Trajectory(traj_id=str(b), group_id="g", prompt_ids=ids[:1], response_ids=ids[1:],
                              logp_behav=[0.0] * (n - 1), versions=[0] * (n - 1), loss_mask=[1] * (n - 1),
                              advantage=0.0, finished=b % 2 == 0,
                              route_segments=[RouteSegment(0, compact(batch.routes[b, :n - 1]), version=0)]))
    return out


class ScoringStrategy:
    """Scores the batch for the anchor and the live trajectories after the optimizer step (both collectives)."""

    name = "scoring"
    exact = True
    uses_live_trajectories = True

    def __init__(self, trainer, ctx) -> None:
        self.trainer, self.ctx = trainer, ctx
        self.seen: dict = {}

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        self.seen["routes"] = batch.routes
        lp = self.trainer.logprobs(batch)
        self.seen["logprobs"] = lp
        return AnchorResult(logp_anchor=lp, exact=True)

    def after_optimizer_step(self, version: int, metrics: dict) -> None:
        live = TrainBatch.from_trajectories(self.ctx.live_trajectories(), version=version)
        self.seen["routes_after"] = live.routes
        self.seen["logprobs_after"] = self.trainer.logprobs(live)

    def close(self) -> None:
        pass


class RecordingTrainer:
    """A follower's trainer that keeps the metrics of its train step (``follow`` drops them)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.metrics = trainer, None

    def train_step(self, batch, loss_fn):
        self.metrics = self.trainer.train_step(batch, loss_fn)
        return self.metrics


def drive_or_follow(trainer, batch, loss_fn) -> dict:
    """One anchor, train step and post-step scoring through the control channel; what this rank saw."""
    import torch.distributed as dist

    from megarl.loop.follower import FollowerView, follow
    from megarl.loop.spmd import ControlChannel, DrivingStrategy, DrivingTrainer

    channel = ControlChannel()
    if dist.get_rank() == 0:
        trajs = trajectories(batch)
        inner = ScoringStrategy(trainer, SimpleNamespace(live_versions=lambda: {0},
                                                         live_trajectories=lambda: list(trajs)))
        strategy, driver = DrivingStrategy(inner, channel), DrivingTrainer(trainer, channel)
        built = TrainBatch.from_trajectories(trajs, version=0)
        anchor = strategy.anchor(built, trajs)
        built.logp_anchor = anchor.logp_anchor
        metrics = driver.train_step(built, loss_fn)
        strategy.after_optimizer_step(trainer.version, metrics)
        driver.stop_followers()
    else:
        view = FollowerView()
        inner = ScoringStrategy(trainer, view)
        recording = RecordingTrainer(trainer)
        follow(recording, inner, channel, lambda b, a: loss_fn, view)
        metrics = recording.metrics
    seen = inner.seen
    same = all(seen[k] is not None and torch.equal(seen[k], batch.routes[:, :seen[k].shape[1]])
               for k in ("routes", "routes_after"))
    return {"logprobs": seen["logprobs"].tolist(), "logprobs_after": seen["logprobs_after"].tolist(),
            "metrics": metrics, "routes_as_sent": same}
