"""A rank's part of a checkpoint written in the background (``logging.async_save``).

An asynchronous checkpoint is taken in two parts. At the step boundary every trainer rank *prepares* its
part (megarl/checkpoint.py ``prepare_rank_state``: the collective layout work and a host copy of its
shards; rank 0 also writes ``controller.pt`` and links the engines' weights into the temp directory), and
the loop goes on. Then each rank *writes* its part on a :class:`BackgroundWrite` thread, over
megarl/trainer/sharded_write.py's checkpoint group; the ranks exchange their outcomes on the same group,
and only when every rank's part is on disk does rank 0 write the manifest and rename the temp directory
into ``step_{n}`` (megarl/checkpoint_dirs.py ``publish_temp_dir``). A kill at any moment before that
rename leaves a ``.tmp-`` directory, which is never read and is removed on resume: the previous
checkpoint stays the newest valid one. A failed write (any rank) removes the temp directory and is
reported when the loop next waits for the write.

Every rank runs its writes one at a time and in the same order: a new save, a load and the end of a
run first join the write in flight.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from megarl.errors import CheckpointError
from megarl.trainer.sharded_write import checkpoint_group

log = logging.getLogger("megarl.checkpoint")


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
        t0 = time.perf_counter()
        ranks = dist.is_available() and dist.is_initialized()  # a plain process (no trainer ranks): nothing to meet
        group = checkpoint_group() if ranks else None
        error = None
        try:
            self._write(group)
        except Exception as e:  # reported to every rank: nobody waits for a part that never comes
            error = f"rank {dist.get_rank() if ranks else 0}: {type(e).__name__}: {e}"
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
            if self._on_failure is not None:
                self._on_failure()
            self.future.set_exception(e)

    def join(self) -> Any:
        """Wait for the write (on a thread that may block); its result, or its failure raised."""
        return self.future.result()
