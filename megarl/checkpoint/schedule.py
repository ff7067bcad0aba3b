"""When the controller checkpoints, and what a failed periodic checkpoint costs.

:class:`CheckpointSchedule` is a collaborator of :class:`megarl.loop.controller.Controller` (its ``checkpoints``),
given the ``checkpointer``, the ``publisher`` (a checkpoint links the engines' disk copy of their version, so it
waits for the publisher's writer: megarl/rollout/disk_copy.py) and the config's ``logging`` section, and at each
call the loop to save (what ``checkpointer.save`` reads: the controller) and its step. It counts the periodic
checkpoints failed in a row (``save_failures``).

A periodic checkpoint (``logging.save_every``) that fails (disk full, an I/O error) leaves no checkpoint
behind that looks valid (``write_checkpoint`` writes into a temp directory and publishes it with one rename)
and the previous one stays: the run goes on and tries again at the next save, and stops only after
``logging.max_save_failures`` failures in a row, blocking or in the background alike. A failure is whatever
the save raises but the interpreter's exit and a cancellation (megarl/checkpoint/writer.py ``is_save_failure``:
torch's ``CheckpointException`` is a ``BaseException``). Any other checkpoint (the end of the run, before a
stop) raises its failure at once, as a :class:`~megarl.errors.CheckpointError`. With
``logging.async_save`` a periodic checkpoint is prepared at the step boundary and written while the run goes
on (megarl/checkpoint/writer.py); its write's failure is counted when the next checkpoint waits for it, and
every other checkpoint waits for it first.
"""
from __future__ import annotations

import logging
import time

from megarl.checkpoint.writer import describe_failure, is_save_failure
from megarl.errors import CheckpointError

log = logging.getLogger("megarl.loop.controller")


class CheckpointSchedule:
    """The controller's checkpoints (module doc)."""

    def __init__(self, checkpointer, publisher, logging_cfg) -> None:
        self.checkpointer = checkpointer
        self.publisher = publisher
        self.logging = logging_cfg  # the run's LoggingConfig: async_save, max_save_failures
        self.save_failures = 0  # periodic checkpoints failed in a row

    async def checkpoint(self, loop, step: int, periodic: bool = False) -> None:
        """Have the checkpointer save ``loop`` at ``step``; a ``periodic`` one may fail and be tried again (module
        doc)."""
        if self.checkpointer is None:
            return
        background = periodic and self.logging.async_save
        await self._join_background(step)  # one write in flight at most; every other checkpoint waits for it
        if self.checkpointer.last_step == step:
            return
        t0 = time.perf_counter()
        try:
            written = getattr(self.publisher, "wait_written", None)  # the engines' disk copy the checkpoint links
            if written is not None:
                await written()
            await self.checkpointer.save(loop, background=background)
        except BaseException as e:
            if not is_save_failure(e) or (not periodic and isinstance(e, Exception)):
                raise
            if not periodic:
                raise CheckpointError(f"the checkpoint of step {step} failed: {describe_failure(e)}") from e
            self._save_failed(e, step)
            return
        if not background:
            self.save_failures = 0
        log.info("step %d: checkpoint %s %.2f s", step, "prepared in" if background else "in",
                 time.perf_counter() - t0)

    async def _join_background(self, step: int) -> None:
        """Wait for the background write of a periodic checkpoint (logging.async_save); its failure counts as a
        failed periodic checkpoint."""
        try:
            if await self.checkpointer.wait() is not None:
                self.save_failures = 0
        except BaseException as e:
            if not is_save_failure(e):
                raise
            self._save_failed(e, step)

    def _save_failed(self, e: BaseException, step: int) -> None:
        self.save_failures += 1
        limit = self.logging.max_save_failures
        cause = describe_failure(e)
        if self.save_failures >= limit:
            raise CheckpointError(
                f"{self.save_failures} checkpoints in a row failed (logging.max_save_failures={limit}); the "
                f"last at step {step}: {cause}. The newest complete checkpoint is still in "
                f"RUN_DIR/checkpoints: free disk space (or fix the error), then resume with --resume") from e
        log.warning("step %d: checkpoint failed (%d in a row of logging.max_save_failures=%d; the previous "
                    "one is kept, the next save tries again): %s", step, self.save_failures, limit, cause)
