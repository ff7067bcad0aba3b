"""Ending a run without losing it: a checkpoint before every way the loop can stop, and on a clock.

* A stop signal (SIGTERM, SIGUSR1 or SIGINT, megarl/stop_protocol.py: a scheduler
  preempting the job, `megarl launch` passing a stop on, Ctrl-C) on rank 0, or on
  any follower rank (rank 0 asks every rank at each step boundary,
  ``DrivingTrainer.followers_stop_reason``): the train step in flight finishes (it
  runs in a worker thread and cannot be abandoned half way), a wait for a batch is
  abandoned, the step's publish is left to the resumed run, every rank checkpoints
  the step reached, rank 0 writes the stop marker `megarl launch` named, and the run
  stops with :class:`RunStopped`, whose exit code is :data:`EXIT_STOPPED` (75, "try
  again": launch/slurm.sbatch requeues the job on it). A repeated signal changes
  nothing. The stop's checkpoint (the wait for a write in flight and for the
  engines' disk copy included) is bounded by the stop budget
  (``logging.stop_grace_s``, megarl/loop/stop_checkpoint.py): one that fails or cannot
  finish in time is reported in one line, and when an earlier complete checkpoint
  stands the run still exits 75 with a marker naming it; with none it fails
  (a CheckpointError saying so), since a requeue would have nothing to resume.
* An error from the train step (before its optimizer step happened), or the
  rollout loop's fatal error: checkpoint, then raise the error. The batch of a
  failed train step counts as a skipped step's (``ReplayBuffer.release``): its
  trajectories are neither trained nor regenerated on resume.
* Every ``logging.save_every`` steps and every ``logging.save_every_s`` seconds.

An error after a step's optimizer step and before the loop counts the step (a
recovery hook, the publish) leaves the newest checkpoint as it was: the
trainer's and the strategy's state no longer match the loop's there.

:class:`RunStops` is a collaborator of :class:`megarl.loop.controller.Controller`
(its ``stops``), given the run's ``cfg``, ``trainer``, ``buffer``, the engines'
``published`` version and the ``checkpointer`` (where its checkpoints are), and
what it calls: ``checkpoint`` (the controller's, at the step reached:
megarl/checkpoint/schedule.py), ``quiesce`` (a stop's collection of partial tokens,
megarl/loop/running_groups.py), ``train_on`` and ``stall_message``
(megarl/loop/step_record.py); the step comes with each call. It owns the stop
request and the save clock.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from time import monotonic as _now  # a test drives the save clock
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from megarl.checkpoint.writer import is_save_failure
from megarl.errors import CheckpointError, TrainingError
from megarl.loop.spmd import DrivingTrainer
from megarl.loop.stop_checkpoint import exit_by_budget_end, newest_checkpoint, stop_checkpoint
from megarl.stop_protocol import EXIT_STOPPED, STOP_SIGNALS, RunStopped, early_stop, stop_budget, write_stop_marker
from megarl.types import Trajectory

if TYPE_CHECKING:  # the loop whose stop signals ask it to stop; controller.py imports this module
    from megarl.loop.controller import Controller

log = logging.getLogger("megarl.loop.run_stop")

__all__ = ["EXIT_STOPPED", "RunStopped", "RunStops", "stop_on_signals"]


class RunStops:
    """The controller's stop requests and checkpoint schedule (module doc)."""

    def __init__(self, cfg, *, trainer, buffer, published, checkpointer,
                 checkpoint: Callable[..., Awaitable[None]], quiesce: Callable[[], Awaitable[None]],
                 train_on: Callable[[list[Trajectory]], dict[str, Any]],
                 stall_message: Callable[[float, int], str]) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.buffer = buffer
        self.published = published
        self.checkpointer = checkpointer
        self.checkpoint = checkpoint  # checkpoint(periodic=False): of the step the loop reached
        self.quiesce = quiesce
        self.train_on = train_on
        self.stall_message = stall_message
        self._stop_reason: str | None = None
        self._stop_event: asyncio.Event | None = None
        self._save_clock: float | None = None  # monotonic time of the last checkpoint (or of the loop's start)

    @property
    def stop_requested(self) -> bool:
        return self._stop_reason is not None

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary (or at once while waiting for a batch); call it on the event loop."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_flag().set()

    def _stop_flag(self) -> asyncio.Event:
        if self._stop_event is None:
            self._stop_event = asyncio.Event()
        return self._stop_event

    async def stop_now(self, step: int) -> None:
        """Checkpoint the step reached (every rank), write the stop marker and raise :class:`RunStopped`; within
        the stop budget (module doc)."""
        stop_budget.start()  # a follower's signal, or one seen by the latch before the loop
        if isinstance(self.trainer, DrivingTrainer):
            self.trainer.stopped_by = self._stop_reason  # the followers exit with 75 too
        reason = self._stop_reason or "stop"
        await self.quiesce()  # every request's partial tokens into the checkpoint (running_groups.py)
        done = await stop_checkpoint(self.checkpoint(), step)
        # RUN_DIR/checkpoints; a checkpointer without one cannot say whether an earlier checkpoint stands
        root = getattr(self.checkpointer, "root", None)
        stands = newest_checkpoint(root)
        if done.failure is None:
            write_stop_marker(reason, step, True, checkpoint=stands)
            raise RunStopped(f"stopped by {reason} at step {step}, checkpointed; continue with "
                             f"`megarl train --resume RUN_DIR` (the same config)")
        if stands is None and root is not None:
            if done.cut_short:
                exit_by_budget_end(1)
            raise CheckpointError(
                f"stopped by {reason} at step {step}, but its checkpoint {done.failure} and the run has no "
                f"earlier checkpoint: nothing to resume from. Free disk space (or fix the error named), then start "
                f"the run again; give a slow checkpoint more time with logging.stop_grace_s")
        write_stop_marker(reason, step, False, checkpoint=stands)
        if done.cut_short:
            exit_by_budget_end(EXIT_STOPPED)
        raise RunStopped(f"stopped by {reason} at step {step}, not checkpointed (its checkpoint "
                         f"{done.failure}); the newest complete checkpoint stands ({stands}): continue from it with "
                         f"`megarl train --resume RUN_DIR` (the same config)")

    async def checkpoint_before_error(self, error: BaseException) -> None:
        """Checkpoint before ``error`` ends the run; a failing save is logged and ``error`` still raised."""
        try:
            await self.checkpoint()
        except BaseException as e:  # e.g. a strategy whose scorer died cannot save its state: the newest one stands
            if not is_save_failure(e):
                raise
            log.warning("the checkpoint before stopping on %s failed (%s: %s); the run's newest checkpoint "
                        "is where --resume goes on", type(error).__name__, type(e).__name__, e)

    async def next_batch(self, roll: asyncio.Task, step: int) -> list[Trajectory]:
        """The next batch; if the rollout loop dies instead, checkpoint and raise its error (no waiting forever
        for data). A stop request abandons the wait.

        A wait of ``trainer.stall_timeout_s`` without any trajectory accepted is a stall (nothing that
        runs can complete a batch, or nothing runs): checkpoint, then stop naming the gate's numbers.
        """
        if self._save_clock is None:
            self._save_clock = _now()
        get = asyncio.ensure_future(self.buffer.get_batch(self.trainer.version, self.published.value))
        stop = asyncio.ensure_future(self._stop_flag().wait())
        timeout = self.cfg.trainer.stall_timeout_s
        accepted = self.buffer.accepted_total
        try:
            while True:
                done, _ = await asyncio.wait({get, roll, stop}, timeout=timeout or None,
                                             return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break
                if self.buffer.accepted_total != accepted:  # trajectories still arrive: slow, not stalled
                    accepted = self.buffer.accepted_total
                    continue
                get.cancel()
                await self.checkpoint()
                raise TrainingError(self.stall_message(timeout, step))
        finally:
            stop.cancel()
        if get.done():
            return get.result()
        get.cancel()
        if self.stop_requested:
            await self.stop_now(step)
        error = roll.exception() or RuntimeError("the rollout loop stopped")
        await self.checkpoint_before_error(error)
        raise error

    async def train_batch(self, trajs: list[Trajectory], episodes: list[Trajectory]) -> dict:
        """The train step on ``trajs`` (the training rows of ``episodes``) in a worker thread (the event loop
        keeps feeding the engines); when it fails before its optimizer step, checkpoint the step reached before
        raising."""
        version = self.trainer.version
        try:
            return await asyncio.to_thread(self.train_on, trajs)
        except Exception as e:
            if self.trainer.version == version:  # no optimizer step: the states still match the loop's step
                self.buffer.release(len(episodes))  # the gate counts episodes, not rows
                await self.checkpoint_before_error(e)
            raise

    async def after_step(self, step: int) -> None:
        """At a step boundary: stop when asked to (here or on any rank), else checkpoint when the step or
        time schedule says so."""
        if not self.stop_requested and isinstance(self.trainer, DrivingTrainer):
            reason = self.trainer.followers_stop_reason()
            if reason is not None:
                self.request_stop(reason)
        if self.stop_requested:
            await self.stop_now(step)
        every, every_s = self.cfg.logging.save_every, self.cfg.logging.save_every_s
        now = _now()
        if ((every > 0 and step % every == 0)
                or (every_s > 0 and self._save_clock is not None and now - self._save_clock >= every_s)):
            await self.checkpoint(periodic=True)  # a failed one is retried (megarl/checkpoint/schedule.py)
            self._save_clock = _now()


@contextlib.contextmanager
def stop_on_signals(controller: Controller) -> Iterator[None]:
    """While the loop runs, a stop signal asks ``controller`` to stop (module doc); enter on the event loop.

    A signal the early latch already holds (megarl/stop_protocol.py) is a stop asked for at once; on exit the
    handlers that were there before (the latch's) come back."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        stop_budget.start()
        if controller.stop_requested:
            log.warning("%s: already stopping", sig.name)
            return
        log.warning("%s: checkpointing the step reached, then stopping (exit code %d)", sig.name, EXIT_STOPPED)
        controller.request_stop(sig.name)

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    if early_stop.received is not None:
        controller.request_stop(early_stop.received)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            if previous[sig] is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, previous[sig])
