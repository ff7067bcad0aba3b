"""Ending a run without losing it: a checkpoint before every way the loop can stop, and on a clock.

* SIGTERM or SIGINT (a scheduler preempting the job, Ctrl-C): the train step in
  flight finishes (it runs in a worker thread and cannot be abandoned half way),
  a wait for a batch is abandoned, the step's publish is left to the resumed run,
  the loop checkpoints the step reached and the run stops with :class:`RunStopped`,
  whose exit code is :data:`EXIT_STOPPED` (75, "try again": a scheduler's job
  script requeues on it, launch/slurm.sbatch). A second signal acts as without
  this handler (SIGINT: KeyboardInterrupt; SIGTERM: the process ends at once).
* An error from the train step (before its optimizer step happened), or the
  rollout loop's fatal error: checkpoint, then raise the error. The batch of a
  failed train step counts as a skipped step's (``ReplayBuffer.release``): its
  trajectories are neither trained nor regenerated on resume.
* Every ``logging.save_every`` steps and every ``logging.save_every_s`` seconds.

An error after a step's optimizer step and before the loop counts the step (a
recovery hook, the publish) leaves the newest checkpoint as it was: the
trainer's and the strategy's state no longer match the loop's there.

:class:`RunStops` is a part of :class:`megarl.controller.Controller` kept in a
file of its own; it reads the controller's ``cfg``, ``step``, ``trainer``,
``buffer``, ``version``, ``checkpointer``, ``_checkpoint`` (megarl/checkpoint_schedule.py)
and the stall message of ``_stall_message``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from time import monotonic as _now  # a test drives the save clock
from typing import Iterator

from megarl.errors import TrainingError
from megarl.types import Trajectory

log = logging.getLogger("megarl.run_stop")

#: exit code of a run stopped by SIGTERM/SIGINT after its checkpoint (sysexits' EX_TEMPFAIL): resume it
EXIT_STOPPED = 75
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(TrainingError):
    """The run was asked to stop (a signal) and checkpointed the step it reached; ``--resume`` continues it."""

    exit_code = EXIT_STOPPED


class RunStops:
    """The controller's stop requests and checkpoint schedule (module doc)."""

    _stop_reason: str | None = None
    _stop_event: asyncio.Event | None = None
    _save_clock: float | None = None  # monotonic time of the last checkpoint (or of the loop's start)

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

    async def _stop_now(self) -> None:
        """Checkpoint the step reached and raise :class:`RunStopped`."""
        await self._checkpoint()
        raise RunStopped(f"stopped by {self._stop_reason} at step {self.step}, checkpointed; continue with "
                         f"`megarl train --resume RUN_DIR` (the same config)")

    async def _checkpoint_before_error(self, error: BaseException) -> None:
        """Checkpoint before ``error`` ends the run; a failing save is logged and ``error`` still raised."""
        try:
            await self._checkpoint()
        except Exception as e:  # e.g. a strategy whose scorer died cannot save its state: the newest one stands
            log.warning("the checkpoint before stopping on %s failed (%s: %s); the run's newest checkpoint "
                        "is where --resume goes on", type(error).__name__, type(e).__name__, e)

    async def _next_batch(self, roll: asyncio.Task) -> list[Trajectory]:
        """The next batch; if the rollout loop dies instead, checkpoint and raise its error (no waiting forever
        for data). A stop request abandons the wait.

        A wait of ``trainer.stall_timeout_s`` without any trajectory accepted is a stall (nothing that
        runs can complete a batch, or nothing runs): checkpoint, then stop naming the gate's numbers.
        """
        if self._save_clock is None:
            self._save_clock = _now()
        get = asyncio.ensure_future(self.buffer.get_batch(self.trainer.version, self.version))
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
                await self._checkpoint()
                raise TrainingError(self._stall_message(timeout))
        finally:
            stop.cancel()
        if get.done():
            return get.result()
        get.cancel()
        if self.stop_requested:
            await self._stop_now()
        error = roll.exception() or RuntimeError("the rollout loop stopped")
        await self._checkpoint_before_error(error)
        raise error

    async def _train_batch(self, trajs: list[Trajectory], episodes: list[Trajectory]) -> dict:
        """The train step on ``trajs`` (the training rows of ``episodes``) in a worker thread (the event loop
        keeps feeding the engines); when it fails before its optimizer step, checkpoint the step reached before
        raising."""
        version = self.trainer.version
        try:
            return await asyncio.to_thread(self._train_on, trajs)
        except Exception as e:
            if self.trainer.version == version:  # no optimizer step: the states still match the loop's step
                self.buffer.release(len(episodes))  # the gate counts episodes, not rows
                await self._checkpoint_before_error(e)
            raise

    async def _after_step(self) -> None:
        """At a step boundary: stop when asked to, else checkpoint when the step or time schedule says so."""
        if self.stop_requested:
            await self._stop_now()
        every, every_s = self.cfg.logging.save_every, self.cfg.logging.save_every_s
        now = _now()
        if ((every > 0 and self.step % every == 0)
                or (every_s > 0 and self._save_clock is not None and now - self._save_clock >= every_s)):
            await self._checkpoint(periodic=True)  # a failed one is retried (megarl/checkpoint_schedule.py)
            self._save_clock = _now()


@contextlib.contextmanager
def stop_on_signals(controller: RunStops) -> Iterator[None]:
    """While the loop runs, SIGTERM and SIGINT ask ``controller`` to stop (module doc); enter on the event loop."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.warning("%s: checkpointing the step reached, then stopping (exit code %d)", sig.name, EXIT_STOPPED)
        for s in _SIGNALS:  # a second signal acts as without this handler
            loop.remove_signal_handler(s)
        controller.request_stop(sig.name)

    for sig in _SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
