"""A follower trainer rank's loop: it replays rank 0's control events (megarl/loop/spmd.py) on its own trainer
and strategy until rank 0 says stop."""
from __future__ import annotations

import logging

from megarl.checkpoint.rank_state import load_rank_state, prepare_rank_state, save_rank_state
from megarl.checkpoint.writer import BackgroundWrite
from megarl.errors import CheckpointError
from megarl.loop.spmd import ControlChannel, _run_on_all, _stop_votes
from megarl.stop_protocol import RunStopped, early_stop
from megarl.types import AnchorResult, TrainBatch, Trajectory

log = logging.getLogger("megarl.spmd")


def _join(writing) -> None:
    """Wait for this follower's background checkpoint write (rank 0 reports a failure: here it is only logged)."""
    if writing is not None:
        try:
            writing.join()
        except CheckpointError as e:
            log.warning("%s", e)
    return None


def _prepare(channel: ControlChannel, step_dir: str, trainer, strategy):
    """This rank's part of rank 0's background checkpoint, prepared with every rank; returns its write."""
    writes = []
    _run_on_all(channel, lambda: writes.append(
        prepare_rank_state(step_dir, trainer, strategy.state_dict(), background=True)))
    return writes[0]


class FollowerView:
    """What a follower's strategy context sees of the loop: rank 0's latest live state."""

    def __init__(self) -> None:
        self.trajectories: list[Trajectory] = []
        self.versions: set[int] = set()

    def live_trajectories(self) -> list[Trajectory]:
        return self.trajectories

    def live_versions(self) -> set[int]:
        return self.versions


def follow(trainer, strategy, channel: ControlChannel, loss_fn_factory, view: FollowerView) -> None:
    """A follower rank's loop: replay rank 0's events until it says stop.

    ``view`` backs the follower strategy's ``ctx.live_trajectories`` and
    ``ctx.live_versions``: rank 0 sends its live versions with every event and
    its live trajectories with every hook.
    """
    batch: TrainBatch | None = None
    anchor: AnchorResult | None = None
    writing: BackgroundWrite | None = None  # this rank's part of a background checkpoint, in flight
    while True:
        event = channel.recv()
        kind = event[0]
        if kind == "hooks":
            _, pending, view.versions = event
            for name, args in pending:
                getattr(strategy, name)(*args)
        elif kind == "hook":
            _, name, args, live_trajs = event
            if live_trajs is not None:
                view.trajectories = live_trajs
            getattr(strategy, name)(*args)
        elif kind == "anchor":
            _, version, trajs = event
            batch = TrainBatch.from_trajectories(trajs, version=version)
            mine = strategy.anchor(batch, trajs)
            shared = channel.share_tensor(None)
            anchor = AnchorResult(logp_anchor=shared, exact=mine.exact, from_theta=mine.from_theta)
            if anchor.logp_anchor is not None:
                batch.logp_anchor = anchor.logp_anchor
        elif kind == "train_step":
            # the entropy coefficient rank 0 used (None: a loss without one; the factory's own then)
            given = {} if len(event) < 2 or event[1] is None else {"entropy_coef": event[1]}
            trainer.train_step(batch, loss_fn_factory(batch, anchor, **given))
        elif kind == "save_hf_checkpoint":
            trainer.save_hf_checkpoint(event[1])
        elif kind == "export_hf_weights":
            for _ in trainer.export_hf_weights(to_host=False):  # only the gathers: no host copy to discard
                pass
        elif kind == "save_state_async":
            writing = _join(writing)
            writing = BackgroundWrite(_prepare(channel, event[1], trainer, strategy),
                                      f"{event[1]} (rank {channel.rank})")
        elif kind == "save_state":
            writing = _join(writing)
            _run_on_all(channel, lambda path=event[1]: save_rank_state(path, trainer, strategy.state_dict()))
        elif kind == "load_state":
            writing = _join(writing)
            _run_on_all(channel, lambda path=event[1]: load_rank_state(path, trainer, strategy))
        elif kind == "stop_poll":
            _stop_votes(channel, early_stop.received)
        elif kind == "stop":
            writing = _join(writing)
            if len(event) > 1 and event[1]:
                raise RunStopped(f"rank 0 stopped the run ({event[1]}) after the checkpoint every rank wrote")
            return
        else:
            raise RuntimeError(f"unknown control event {kind!r}")
