"""Several trainer ranks, one controller: rank 0 drives, the other ranks follow.

Every trainer rank builds the same MegatronTrainer and the same recovery
strategy (each holds only its own parameter shards, so a strategy's copies of
old versions are sharded like the model). Rank 0 alone runs the controller,
engines, rewards and dataset. Everything that touches the trainer is a
collective, so rank 0 announces it first on a gloo control group and every
follower replays it on its own trainer and strategy, in the same order:

* strategy hooks (``DrivingStrategy`` broadcasts each call with its
  arguments; cheap notifications such as ``on_segment_finished`` are queued
  and shipped with the next collective event, so they never race with a train
  step running in a worker thread). A hook may run forwards (collectives) on
  what ``ctx.live_trajectories`` / ``ctx.live_versions`` return, so every
  hook event carries rank 0's live versions, and its live trajectories unless
  the strategy says it never reads them (``uses_live_trajectories``); rank 0
  runs its own hook on exactly what it sent. ``after_optimizer_step`` runs
  while the event loop still extends trajectories: there the unfinished ones
  go as copies taken once, so rank 0 and the followers see the same tokens;
* ``anchor``: followers rebuild the same TrainBatch from the same
  trajectories and call their strategy (its forwards are collectives), then
  take rank 0's anchor tensor, so a strategy whose anchor only rank 0 can
  compute (the dedicated model's process lives on rank 0) still trains
  consistently;
* ``train_step``, ``save_hf_checkpoint`` and ``export_hf_weights``
  (``DrivingTrainer``; followers consume the export's gathers and drop the tensors);
* stops (megarl/loop/run_stop.py): at every step boundary rank 0 asks every rank
  whether it caught a stop signal (``stop_poll``, an all-gather of each rank's
  latch, megarl/stop_protocol.py), so a signal that reached only a follower stops
  the run too; the final ``stop`` event says whether the run stopped on a signal,
  and then every follower exits with 75 like rank 0;
* checkpoints: ``save_state`` / ``load_state`` (``DrivingTrainer.save_rank_states`` /
  ``load_rank_states``). Rank 0 announces the checkpoint directory, then every
  rank takes part in the collective save (load) of the trainer's and the
  strategy's sharded state (megarl/checkpoint/rank_state.py); an all-gather of each rank's outcome ends the event,
  so rank 0 publishes the checkpoint only after every shard is on disk, and a
  follower's failure is raised on rank 0 too. A background checkpoint
  (``save_state_async``) prepares the same way, then every rank writes its part
  on a thread and the outcomes meet on the checkpoint group
  (megarl/checkpoint/writer.py); a follower joins its write before the next
  checkpoint event and before it stops.

With one rank none of this is used: the loop talks to the trainer directly.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megarl.checkpoint.rank_state import load_rank_state, prepare_rank_state, save_rank_state
from megarl.checkpoint.writer import describe_failure, is_save_failure
from megarl.errors import CheckpointError, MegarlError
from megarl.stop_protocol import RunStopped
from megarl.trainer.parallel import collective_timeout
from megarl.types import AnchorResult, TrainBatch, Trajectory

log = logging.getLogger("megarl.spmd")

#: a trajectory's per-token lists; an append extends them one after the other
_PER_TOKEN = ("response_ids", "logp_behav", "versions", "loss_mask")


def frozen_copy(traj: Trajectory) -> Trajectory:
    """A copy of ``traj`` that another thread may be extending, cut to the tokens every list already holds."""
    d = traj.to_dict()  # each list is copied whole, but one append may land between two lists' copies
    keys = _PER_TOKEN + (("logp_old",) if d["logp_old"] is not None else ())
    n = min(len(d[k]) for k in keys)
    for k in keys:
        d[k] = d[k][:n]
    return Trajectory.from_dict(d)


def share_go(world: int, *, run_dir: str = "", error: str = "", stopped: str = "") -> None:
    """Rank 0: tell the other trainer ranks that the run starts in ``run_dir``, or why it does not (``error``;
    ``stopped``: a stop signal, before anything was written)."""
    if world > 1:
        dist.broadcast_object_list([run_dir, error, stopped], src=0)


def receive_go() -> str:
    """A follower: rank 0's run directory once its checks passed; MegarlError with its reason when they failed,
    RunStopped when rank 0 stopped on a signal first."""
    box: list[Any] = [None, None, None]
    dist.broadcast_object_list(box, src=0)
    run_dir, error, stopped = box
    if stopped:
        raise RunStopped(f"rank 0 stopped by {stopped} before the run started")
    if error:
        raise MegarlError(f"rank 0 refused the run: {error}")
    return run_dir


class ControlChannel:
    """Pickled events from rank 0 to every other rank, over a dedicated gloo group."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=collective_timeout())  # trainer.collective_timeout_s
        self.rank = dist.get_rank()
        self.lock = threading.Lock()

    def send(self, event: tuple) -> None:
        box = [event]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def recv(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def share_tensor(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Rank 0's tensor (or None) on every rank (shape sent first)."""
        shape = [tuple(t.shape) if t is not None else None]
        dist.broadcast_object_list(shape, src=0, group=self.group)
        if shape[0] is None:
            return None
        buf = t.contiguous().float() if self.rank == 0 else torch.empty(shape[0], dtype=torch.float32)
        dist.broadcast(buf, src=0, group=self.group)
        return buf

    def gather_errors(self, error: str | None) -> list[str]:
        """Every rank's error (None when it succeeded); all ranks get the full list. Also a barrier."""
        box: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(box, error, group=self.group)
        return [f"rank {r}: {e}" for r, e in enumerate(box) if e is not None]


class DrivingStrategy:
    """Rank 0's view of the strategy: every hook is replayed on the followers."""

    def __init__(self, inner, channel: ControlChannel) -> None:
        self.inner = inner
        self.channel = channel
        self.exact = inner.exact
        self.name = inner.name
        self._uses_live = inner.uses_live_trajectories
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()

    def _event(self, *event) -> set[int]:
        """Send queued notifications, rank 0's live versions and ``event``; returns the versions sent."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        # followers see rank 0's live versions, so their snapshot stores free exactly the same versions
        live_versions = set(self.inner.ctx.live_versions())
        with self.channel.lock:
            self.channel.send(("hooks", pending, live_versions))
            self.channel.send(event)
        return live_versions

    @contextmanager
    def _pinned(self, live_versions: set[int], live: list[Trajectory] | None) -> Iterator[None]:
        """Rank 0's hook sees the live state it sent to the followers, not a later one."""
        ctx = self.inner.ctx
        saved = ctx.live_versions, ctx.live_trajectories
        ctx.live_versions = lambda: set(live_versions)
        if live is not None:
            ctx.live_trajectories = lambda: list(live)
        try:
            yield
        finally:
            ctx.live_versions, ctx.live_trajectories = saved

    def _hook(self, name: str, args: tuple, live: Callable[[], list[Trajectory]]) -> None:
        """Run hook ``name`` on every rank, with rank 0's live trajectories when the strategy reads them."""
        trajs = live() if self._uses_live else None
        versions = self._event("hook", name, args, trajs)
        with self._pinned(versions, trajs):
            getattr(self.inner, name)(*args)

    # notifications: queued, shipped with the next event
    def on_segment_finished(self, traj: Trajectory) -> None:
        with self._pending_lock:
            self._pending.append(("on_segment_finished", (traj,)))
        self.inner.on_segment_finished(traj)

    def on_rollout_interrupted(self, partials: list[Trajectory]) -> None:
        with self._pending_lock:
            self._pending.append(("on_rollout_interrupted", (partials,)))
        self.inner.on_rollout_interrupted(partials)

    # collective hooks
    def before_publish(self, old_version: int, new_version: int) -> None:
        # on the event loop with generation stopped: nothing changes the trajectories until it returns,
        # and the strategy must write into the real ones (their old version is about to go)
        self._hook("before_publish", (old_version, new_version), self.inner.ctx.live_trajectories)

    def on_weights_published(self, version: int) -> None:
        self._hook("on_weights_published", (version,), self.inner.ctx.live_trajectories)

    def after_optimizer_step(self, version: int, metrics: dict) -> None:
        # in the trainer's thread while the event loop appends tokens and finishes trajectories: finished
        # ones no longer change, the others are frozen here once, for rank 0 and the followers alike
        self._hook("after_optimizer_step", (version, metrics),
                   lambda: [t if t.finished else frozen_copy(t) for t in self.inner.ctx.live_trajectories()])

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        self._event("anchor", batch.version, trajs)
        result = self.inner.anchor(batch, trajs)
        with self.channel.lock:
            self.channel.share_tensor(result.logp_anchor)
        return result

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def overhead(self) -> dict:
        return self.inner.overhead()

    def close(self) -> None:
        self.inner.close()


class DrivingTrainer:
    """Rank 0's view of the trainer (a TrainerProtocol): collective calls are announced to the followers first.

    Recovery strategies score with rank 0's own trainer (``trainer``), never through this view: their
    forwards reach the followers as replayed hooks.
    """

    def __init__(self, trainer, channel: ControlChannel) -> None:
        self.trainer = trainer
        self.channel = channel
        #: the stop signal the run stopped on (set by megarl/loop/run_stop.py); sent with the final ``stop``
        self.stopped_by: str | None = None
        #: a collective with the followers timed out (a trainer node lost): the final ``stop`` is not sent, it
        #: would wait out trainer.collective_timeout_s once more (set by megarl/builder.py, Run.__aexit__)
        self.followers_lost = False

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def last_skip_reason(self) -> str | None:
        return self.trainer.last_skip_reason

    def exported_hf_config(self) -> dict:
        return self.trainer.exported_hf_config()

    def train_step(self, batch: TrainBatch, loss_fn) -> dict:
        with self.channel.lock:  # the followers build the same loss, with the entropy coefficient rank 0 uses
            self.channel.send(("train_step", getattr(loss_fn, "entropy_coef", None)))
        return self.trainer.train_step(batch, loss_fn)

    def save_hf_checkpoint(self, out_dir: str):
        with self.channel.lock:
            self.channel.send(("save_hf_checkpoint", out_dir))
        return self.trainer.save_hf_checkpoint(out_dir)

    def export_hf_weights(self, *, to_host: bool = True):
        """The full HF tensors (``to_host=False``: on this rank's device); consume the iterator to the end
        (the followers take part in its gathers)."""
        with self.channel.lock:
            self.channel.send(("export_hf_weights",))
        return self.trainer.export_hf_weights(to_host=to_host)

    def save_rank_states(self, step_dir: str, strategy_state: dict) -> None:
        """Every rank writes its trainer and strategy state into ``step_dir``; returns once all have."""
        with self.channel.lock:
            self.channel.send(("save_state", step_dir))
            _run_on_all(self.channel, lambda: save_rank_state(step_dir, self.trainer, strategy_state))

    def prepare_rank_states(self, step_dir: str, strategy_state: dict):
        """Every rank prepares its part of a background checkpoint (megarl/checkpoint/writer.py) and starts writing
        it; returns rank 0's write, to run on a BackgroundWrite (its outcome exchange meets the followers')."""
        writes = []
        with self.channel.lock:
            self.channel.send(("save_state_async", step_dir))
            _run_on_all(self.channel, lambda: writes.append(
                prepare_rank_state(step_dir, self.trainer, strategy_state, background=True)))
        return writes[0]

    def load_rank_states(self, step_dir: str, strategy) -> None:
        """Every rank loads its trainer and strategy state from ``step_dir``."""
        with self.channel.lock:
            self.channel.send(("load_state", step_dir))
            _run_on_all(self.channel, lambda: load_rank_state(step_dir, self.trainer, strategy))

    def followers_stop_reason(self) -> str | None:
        """At a step boundary: the first stop signal a follower rank caught (``"SIGTERM on rank 1"``), or None."""
        with self.channel.lock:
            self.channel.send(("stop_poll",))
            return _stop_votes(self.channel, None)

    def stop_followers(self) -> None:
        if self.followers_lost:
            log.warning("the followers' stop was not sent: a collective with them timed out")
            return
        with self.channel.lock:
            self.channel.send(("stop", self.stopped_by))


def _stop_votes(channel: ControlChannel, mine: str | None) -> str | None:
    box: list[Any] = [None] * dist.get_world_size(channel.group)
    dist.all_gather_object(box, mine, group=channel.group)
    return next((f"{sig} on rank {r}" for r, sig in enumerate(box) if sig is not None), None)


def _run_on_all(channel: ControlChannel, fn) -> None:
    """Run ``fn`` on this rank, then compare outcomes with every rank; rank 0 raises any rank's error."""
    error = None
    try:
        fn()
    except BaseException as e:  # reported to every rank, so nobody waits in a collective that never comes
        if not is_save_failure(e):  # an interrupt or exit keeps its meaning
            raise
        error = describe_failure(e)  # torch's CheckpointException is a BaseException
        if channel.rank == 0:
            channel.gather_errors(error)
            raise
    errors = channel.gather_errors(error)
    if errors and channel.rank == 0:
        raise CheckpointError("checkpoint state failed on " + "; ".join(errors))
    if error is not None:
        raise MegarlError(f"rank {channel.rank}: {error}")
