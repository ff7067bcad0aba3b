"""When the controller checkpoints, and what a failed periodic checkpoint costs.

:class:`CheckpointSchedule` is a part of :class:`megarl.loop.controller.Controller` kept in a file of its own;
it reads the controller's ``checkpointer``, ``step``, ``cfg``, ``_save_failures`` and ``publisher`` (a checkpoint
links the engines' disk copy of their version, so it waits for the publisher's writer: megarl/rollout/disk_copy.py).

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

    async def _checkpoint(self, periodic: bool = False) -> None:
        if self.checkpointer is None:
            return
        background = periodic and self.cfg.logging.async_save
        await self._join_background()  # one write in flight at most; every other checkpoint waits for it
        if self.checkpointer.last_step == self.step:
            return
        t0 = time.perf_counter()
        try:
            written = getattr(self.publisher, "wait_written", None)  # the engines' disk copy the checkpoint links
            if written is not None:
                await written()
            await self.checkpointer.save(self, background=background)
        except BaseException as e:
            if not is_save_failure(e) or (not periodic and isinstance(e, Exception)):
                raise
            if not periodic:
                raise CheckpointError(f"the checkpoint of step {self.step} failed: {describe_failure(e)}") from e
            self._save_failed(e)
            return
        if not background:
            self._save_failures = 0
        log.info("step %d: checkpoint %s %.2f s", self.step, "prepared in" if background else "in",
                 time.perf_counter() - t0)

    async def _join_background(self) -> None:
        """Wait for the background write of a periodic checkpoint (logging.async_save); its failure counts as a
        failed periodic checkpoint."""
        try:
            if await self.checkpointer.wait() is not None:
                self._save_failures = 0
        except BaseException as e:
            if not is_save_failure(e):
                raise
            self._save_failed(e)

    def _save_failed(self, e: BaseException) -> None:
        self._save_failures += 1
        limit = self.cfg.logging.max_save_failures
        cause = describe_failure(e)
        if self._save_failures >= limit:
            raise CheckpointError(
                f"{self._save_failures} checkpoints in a row failed (logging.max_save_failures={limit}); the "
                f"last at step {self.step}: {cause}. The newest complete checkpoint is still in "
                f"RUN_DIR/checkpoints: free disk space (or fix the error), then resume with --resume") from e
        log.warning("step %d: checkpoint failed (%d in a row of logging.max_save_failures=%d; the previous "
                    "one is kept, the next save tries again): %s", self.step, self._save_failures, limit, cause)
