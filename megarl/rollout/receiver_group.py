"""An engine's end of the weight broadcast group: every receive is bounded, and the publish can call it off.

A lost engine must cost that engine alone. Under gloo a receiver learns of a
failed publish when the trainer's sender process dies (its sockets close);
under NCCL it does not: a survivor sits in ``broadcast().wait()`` until the
communicator's timeout, and then NCCL's watchdog ends the whole worker (the
engine is lost as well). So a receiver never blocks on a collective alone.
:meth:`ReceiverGroup.broadcast` returns a work whose ``wait`` polls
completion and, every :data:`POLL_S` seconds, the group's rendezvous
(megarl/rollout/rendezvous.py); it leaves the broadcast, raising
:class:`BroadcastLeft`, when

* the publisher marked the publish aborted (its sender failed or missed a
  step deadline: megarl/rollout/publish.py), or the rendezvous is gone with the
  trainer;
* no collective completed for ``timeout_s`` (the group's step deadline, the
  same one the trainer's side keeps).

The engine's weight update then fails with that error, its lock is released,
and the publisher has the live engines load the disk copy of the version.

The first collective of a group is bounded the same way. NCCL creates a
communicator lazily, inside the first collective call itself
(``ncclCommInitRank``, which returns only once every rank has come): a sender
that dies before or during that init would hold the engine in the call, with
its update lock, for good. So the first call runs in a helper thread while
the engine's thread watches the same abort mark and deadline; the deadline of
the first receive counts from the start of that init.
The communicator's own timeout is set past these bounds
(:func:`communicator_timeout`), so the receiver leaves before any watchdog
fires; leaving an NCCL group aborts its communicator (``ProcessGroup.abort``),
which frees the GPU stream the pending broadcast holds. That last step, and
the watchdog ordering, only a GPU with NCCL can show; on CPU the same code
runs over gloo.
"""
from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch

from megarl.errors import EngineError

#: seconds between two looks at the rendezvous while a receive is pending
POLL_S = 0.5
#: NCCL: the longest sleep between two completion checks, what a completed collective may wait to be seen (a
#: bucket is three collectives; ``is_completed`` is what tells NCCL work done on the host, whose ``wait`` does
#: not block); gloo blocks in ``wait(timeout)`` instead
MAX_PAUSE_S = 2e-4
#: NCCL: how long leaving waits for ``ProcessGroup.abort`` before it raises anyway
ABORT_WAIT_S = 5.0


class BroadcastLeft(EngineError):
    """This engine left a broadcast publish that will not complete; its weights may be partly updated."""


def communicator_timeout(timeout_s: float) -> timedelta:
    """The process group's own timeout: past a receiver's bound, so the receiver leaves first."""
    return timedelta(seconds=2 * timeout_s + 30)


class ReceiverGroup:
    """A joined broadcast group seen from an engine rank: ``broadcast(t, 0).wait()`` as on a process group."""

    def __init__(self, pg, store, backend: str, timeout_s: float) -> None:
        self.pg, self.store, self.backend, self.timeout_s = pg, store, backend, timeout_s
        #: why this rank left the group (None: still in it)
        self.left: str | None = None
        #: whether a collective call has returned (under NCCL: the communicator exists)
        self.started = False

    def broadcast(self, tensor, src: int) -> "_BoundedWork":
        if self.left is not None:
            raise BroadcastLeft(f"weight broadcast group left before ({self.left}); the next publish makes a new one")
        if self.started:
            return _BoundedWork(self, self.pg.broadcast(tensor, src))
        start = time.monotonic()
        return _BoundedWork(self, self._first_call(tensor, src, start), start)

    def _first_call(self, tensor, src: int, start: float):
        """The first ``pg.broadcast`` (module doc: NCCL's communicator init happens in it) in a helper thread,
        under the abort mark and the deadline; the work it returned."""
        out: dict = {}
        # CUDA's current device and stream are per thread: the helper takes the engine thread's
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

        def call() -> None:
            try:
                if stream is not None:
                    torch.cuda.set_device(tensor.device)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    out["work"] = self.pg.broadcast(tensor, src)
            except BaseException as e:  # noqa: BLE001 - raised in the engine's thread below
                out["error"] = e

        th = threading.Thread(target=call, name="weight-group-init", daemon=True)
        th.start()
        while True:
            th.join(POLL_S)
            if not th.is_alive():
                break
            self.check(start, time.monotonic(), "while the communicator was set up (the first collective)")
        if "error" in out:
            raise out["error"]
        self.started = True
        return out["work"]

    def check(self, start: float, now: float, where: str = "") -> None:
        """Leave (:meth:`leave`) when the publish was called off or nothing came for ``timeout_s`` since ``start``."""
        reason = self.publish_over()
        if reason is not None:
            self.leave(reason)
        if now - start >= self.timeout_s:
            self.leave(f"no data from the trainer for {self.timeout_s:g} s (the group's step deadline)"
                       + (f" {where}" if where else ""))

    def publish_over(self) -> str | None:
        """Why the publisher called this broadcast off, or None while it goes on."""
        try:
            return self.store.aborted()
        except EngineError as e:
            return f"the rendezvous is gone ({e})"

    def leave(self, reason: str) -> None:
        """Leave the group for good and raise :class:`BroadcastLeft`."""
        self.left = reason
        if self.backend == "nccl":  # free the stream the pending broadcast holds (GPU only)
            # in a thread of its own, waited for a while: an abort that waits on a communicator still being
            # set up must not hold the engine either
            aborting = threading.Thread(target=_abort, args=(self.pg,), name="weight-group-abort", daemon=True)
            aborting.start()
            aborting.join(ABORT_WAIT_S)
        raise BroadcastLeft(f"left the weight broadcast: {reason}; the publisher falls back to the disk copy")


def _abort(pg) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - torn down already; nothing more to free
        pass


class _BoundedWork:
    def __init__(self, group: ReceiverGroup, work, start: float | None = None) -> None:
        #: when the deadline's clock started: the first call's init (None: at ``wait``)
        self.group, self.work, self.start = group, work, start

    def wait(self) -> bool:
        start = time.monotonic() if self.start is None else self.start
        if self.group.backend == "gloo":
            return self._wait_blocking(start)
        return self._wait_polling(start)

    def _wait_blocking(self, start: float) -> bool:
        """gloo: ``wait(timeout)`` blocks until done, or raises once the timeout passed with the work still on."""
        work = self.work
        while True:
            try:
                return work.wait(timedelta(seconds=POLL_S))
            except RuntimeError:
                if work.is_completed():  # a real failure (or done just now): wait() says which
                    return work.wait()
            self.group.check(start, time.monotonic())

    def _wait_polling(self, start: float) -> bool:
        """NCCL: ``wait()`` returns on the host before the data is there; ``is_completed()`` tells."""
        work = self.work
        next_poll, pause = start + POLL_S, 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_poll:
                self.group.check(start, now)
                next_poll = now + POLL_S
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
        return work.wait()
