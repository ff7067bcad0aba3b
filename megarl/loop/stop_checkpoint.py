"""The checkpoint of a stopping run, bounded by the stop budget (megarl/stop_protocol.py ``stop_budget``).

A stop signal gives the run ``logging.stop_grace_s`` seconds to leave; `megarl launch` and torchrun kill what
is left after that and some margin. The stop's checkpoint (megarl/loop/run_stop.py) waits for a background write in
flight, for the engines' disk copy of their version and then writes: any of these can take longer than the
budget (a large model on a slow disk, a publish in flight) or fail (the disk full). :func:`stop_checkpoint`
runs it with what is left of the budget, less :func:`exit_reserve_s` for the stop marker and the engines'
shutdown, and says how it went; :func:`newest_checkpoint` names the checkpoint that stands.

A wait cut short may leave a thread writing (asyncio cannot stop a thread), and the interpreter waits for such
a thread at exit. :func:`exit_by_budget_end` then ends the process at the end of the budget, plus the reserve,
with the exit code the stop path decided: a stopped run never outlasts its budget by more than that. A write
that completes before then publishes its checkpoint whole (a rename), which a resume takes as the newest;
one killed before leaves a temp directory that is never read.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Awaitable

from megarl.checkpoint.dirs import list_checkpoints
from megarl.checkpoint.writer import describe_failure, is_save_failure
from megarl.stop_protocol import stop_budget

log = logging.getLogger("megarl.loop.run_stop")


@dataclass(frozen=True)
class StopCheckpoint:
    """How the stop's checkpoint went: ``failure`` None when it is on disk, else what happened to it (a phrase:
    "failed (...)", "did not finish ..."); ``cut_short``: it was still running when the budget ran out."""

    failure: str | None = None
    cut_short: bool = False


def exit_reserve_s() -> float:
    """Seconds of the budget kept from the checkpoint for what follows it (the marker, the engines' shutdown)."""
    return min(5.0, 0.1 * stop_budget.grace_s)


async def stop_checkpoint(checkpoint: Awaitable[None], step: int) -> StopCheckpoint:
    """Await ``checkpoint`` (the stop's, of ``step``) within what is left of the stop budget (module doc)."""
    left = stop_budget.remaining()
    task = asyncio.ensure_future(checkpoint)
    try:
        await asyncio.wait({task}, timeout=None if left is None else max(0.0, left - exit_reserve_s()))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()  # a thread it waits for goes on (module doc)
        await asyncio.wait({task})
        stop_budget.unfinished(f"the checkpoint of step {step}")
        return StopCheckpoint(f"did not finish within logging.stop_grace_s={stop_budget.grace_s:g} s", True)
    e = None if task.cancelled() else task.exception()
    if e is None:
        return StopCheckpoint()
    if not is_save_failure(e):
        raise e
    stop_budget.cut_short.append(f"the checkpoint of step {step} (failed: {describe_failure(e)})")
    log.warning("stop: the checkpoint of step %d failed: %s", step, describe_failure(e))
    return StopCheckpoint(f"failed ({describe_failure(e)})")


def newest_checkpoint(root) -> str | None:
    """The newest complete checkpoint under ``root`` (RUN_DIR/checkpoints; its directory), None when there is none."""
    found = list_checkpoints(root) if root is not None else []
    return str(found[-1][1]) if found else None


_exit_timer: threading.Timer | None = None


def exit_by_budget_end(code: int) -> None:
    """End the process with ``code`` at the end of the stop budget plus :func:`exit_reserve_s`, if it is still
    there then (module doc); the first call counts."""
    global _exit_timer
    if _exit_timer is not None:
        return
    left = stop_budget.remaining() or 0.0

    def leave() -> None:
        print(f"megarl: the stop budget (logging.stop_grace_s={stop_budget.grace_s:g} s) is spent and a write cut "
              f"short still runs; exiting with {code} (the stop marker names the checkpoint that stands)",
              file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(code)

    _exit_timer = threading.Timer(left + exit_reserve_s(), leave)
    _exit_timer.daemon = True
    _exit_timer.start()


def cancel_exit() -> None:
    """Call off :func:`exit_by_budget_end` (a process that goes on, e.g. one that runs several runs)."""
    global _exit_timer
    if _exit_timer is not None:
        _exit_timer.cancel()
        _exit_timer = None
