"""A rank's part of a checkpoint written in the background (``logging.async_save``).

An asynchronous checkpoint is taken in two parts. At the step boundary every trainer rank *prepares* its
part (megarl/checkpoint/rank_state.py ``prepare_rank_state``: the collective layout work and a host copy of its
shards; rank 0 also writes ``controller.pt`` and links the engines' weights into the temp directory), and
the loop goes on. Then each rank *writes* its part on a :class:`BackgroundWrite` thread, over
megarl/trainer/sharded_write.py's checkpoint group; the ranks exchange their outcomes on the same group,
and only when every rank's part is on disk does rank 0 write the manifest and rename the temp directory
into ``step_{n}`` (megarl/checkpoint/dirs.py ``publish_temp_dir``). A kill at any moment before that
rename leaves a ``.tmp-`` directory, which is never read and is removed on resume: the previous
checkpoint stays the newest valid one. A failed write (any rank) removes the temp directory and is
reported when the loop next waits for the write.

What a save raises. torch's distributed checkpoint raises ``CheckpointException``, a ``BaseException``
subclass (the disk full, a file-size limit, an I/O error on any rank), which ``except Exception`` does not
catch: :func:`torch_save_errors` turns it into a :class:`~megarl.errors.CheckpointError` naming each rank's
error where megarl calls torch's writer, and :func:`is_save_failure` tells what a caller counts as a failed
save: anything a save raises except the interpreter's own (``KeyboardInterrupt``, ``SystemExit``,
``GeneratorExit``) and the cancellation of the task that waits for it, which keep their meaning, and a
collective that timed out waiting for another rank (megarl/trainer/parallel.py ``timed_out_collective``): a
trainer node lost, which the next save would only wait out again, so the run stops at once. The write
thread reports whatever ends it (a ``SystemExit`` there would otherwise end the thread silently and leave every
rank waiting for its outcome).

Every rank runs its writes one at a time and in the same order: a new save, a load and the end of a
run first join the write in flight.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megarl.errors import CheckpointError
from megarl.trainer.parallel import timed_out_collective
from megarl.trainer.sharded_write import checkpoint_group

log = logging.getLogger("megarl.checkpoint.run_checkpoint")

#: what no save failure is, whatever raised it: these keep their meaning (module doc)
NOT_SAVE_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


def is_save_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by a save, is that save failing (module doc)."""
    if isinstance(e, NOT_SAVE_FAILURES) or timed_out_collective(e) is not None:
        return False
    if isinstance(e, CheckpointException):  # each rank's own error
        return not any(timed_out_collective(exc) is not None for exc, _ in e.failures.values())
    return True


def describe_failure(e: BaseException) -> str:
    """``e`` in one line; torch's CheckpointException as each failed rank's own error."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"{type(e).__name__}: {e}"


#: below this many free bytes a failed save's error says the disk is full: torch's writer reports ENOSPC as
#: its zip writer's "unexpected pos" rather than the OS error
LOW_SPACE_BYTES = 64 << 20


def short_write_note(e: BaseException) -> str:
    """'' or what a short write means where torch's zip writer reported one as "unexpected pos" (the file
    system took fewer bytes than written: the disk full, a quota, the file-size limit) instead of the OS error,
    naming the process's file-size limit where one is set."""
    if "unexpected pos" not in describe_failure(e):
        return ""
    import resource

    note = "; 'unexpected pos' is a short write: the disk or a quota is full, or a file reached the size limit"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        note += (f"; this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) is {limit} bytes, and a write past "
                 f"it fails with EFBIG (File too large): raise the limit")
    return note


def disk_note(path: str) -> str:
    """'' or a note that the filesystem of ``path`` (or its nearest existing parent) is (nearly) full."""
    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return ""
    return f"; the filesystem of {where} has {free / 2**20:.1f} MiB free: it is (nearly) full" \
        if free < LOW_SPACE_BYTES else ""


@contextlib.contextmanager
def torch_save_errors(what: str, path: str) -> Iterator[None]:
    """Around a call of torch's checkpoint writer into ``path``: its CheckpointException becomes a
    CheckpointError, which says so when the disk is full."""
    try:
        yield
    except CheckpointException as e:
        raise CheckpointError(f"{what} could not be written ({describe_failure(e)}{disk_note(path)}"
                              f"{short_write_note(e)}); the "
                              f"previous checkpoint stands: free disk space or fix the error named") from e


class BackgroundWrite:
    """``write(group)`` on a daemon thread, then every rank's outcome; on rank 0 ``then()`` once all succeeded.

    ``future`` resolves to ``then()``'s result (None without it) or to the CheckpointError naming the
    ranks that failed (``on_failure()`` has run then).
    """

    def __init__(self, write: Callable[[Any], None], label: str, then: Callable[[], Any] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        self.label = label
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.seconds: float | None = None
        self._write, self._then, self._on_failure = write, then, on_failure
        self._thread = threading.Thread(target=self._run, name="megarl-checkpoint-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write_and_meet()
        finally:
            if not self.future.done():  # nothing may leave a waiter without an outcome
                self.future.set_exception(CheckpointError(f"the background write of {self.label} ended without "
                                                          f"an outcome"))

    def _write_and_meet(self) -> None:
        t0 = time.perf_counter()
        ranks = dist.is_available() and dist.is_initialized()  # a plain process (no trainer ranks): nothing to meet
        group = checkpoint_group() if ranks else None
        error = None
        try:
            self._write(group)
        except BaseException as e:  # reported to every rank: nobody waits for a part that never comes
            error = f"rank {dist.get_rank() if ranks else 0}: {describe_failure(e)}"
        try:
            errors: list = [error]
            if ranks:
                errors = [None] * dist.get_world_size(group)
                dist.all_gather_object(errors, error, group=group)
            failed = [e for e in errors if e is not None]
            if failed:
                raise CheckpointError(f"the background write of {self.label} failed: " + "; ".join(failed))
            result = self._then() if self._then is not None else None
            self.seconds = time.perf_counter() - t0
            self.future.set_result(result)
        except BaseException as e:
            try:
                if self._on_failure is not None:
                    self._on_failure()
            finally:
                self.future.set_exception(e if isinstance(e, Exception) else CheckpointError(
                    f"the background write of {self.label} failed: {describe_failure(e)}"))

    def join(self) -> Any:
        """Wait for the write (on a thread that may block); its result, or its failure raised."""
        return self.future.result()
