"""A receiver's process group with NCCL's failure semantics, over gloo: NCCL cannot run on this machine.

Under gloo a receiver whose sender died fails at once (the sockets close).
Under NCCL it does not: the pending collective neither completes nor fails
until the communicator's timeout, and then the watchdog ends the process.
:class:`NcclSemanticsReceiverFake` wraps a real gloo group so that a
collective whose peer was lost looks pending (``is_completed()`` False) and
``wait()`` blocks for the communicator's timeout, then raises as the watchdog
would; ``abort()`` (``ProcessGroup.abort`` under NCCL) ends it at once. A
collective that succeeds is the real gloo one. The real NCCL path is the
same code with ``backend="nccl"`` (megarl/rollout/weight_sync.py), which only
a GPU machine runs (tests/gpu/gpu_check.py).
"""
import threading
import time


class NcclWatchdogTimeout(RuntimeError):
    """What NCCL's watchdog does to a collective past the communicator timeout (here: raised, not an abort)."""


class NcclSemanticsReceiverFake:
    def __init__(self, pg, comm_timeout_s: float) -> None:
        self._pg, self.comm_timeout_s = pg, comm_timeout_s
        self.aborted = threading.Event()
        #: collectives whose peer was lost (gloo said so; NCCL would not have)
        self.n_lost = 0

    def broadcast(self, tensor, src):
        return _Work(self, self._pg.broadcast(tensor, src))

    def abort(self) -> None:
        self.aborted.set()

    def __getattr__(self, name):
        return getattr(self._pg, name)


class _Work:
    def __init__(self, group: NcclSemanticsReceiverFake, work) -> None:
        self.group, self.work, self.start = group, work, time.monotonic()
        self.failed = False

    def is_completed(self) -> bool:
        if self.failed or not self.work.is_completed():
            return False
        try:
            self.work.wait()
            return True
        except Exception:  # noqa: BLE001 - a lost peer: NCCL reports nothing
            self.failed = True
            self.group.n_lost += 1
            return False

    def wait(self, timeout=None) -> bool:
        """Blocks while the collective is pending; with ``timeout``, raises once it passed (as gloo's timed wait)."""
        until = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self.is_completed():
            if self.group.aborted.is_set():
                raise RuntimeError("NCCL communicator aborted")
            if time.monotonic() - self.start >= self.group.comm_timeout_s:
                raise NcclWatchdogTimeout(f"collective past the {self.group.comm_timeout_s:g} s communicator "
                                          "timeout (NCCL's watchdog would end this process)")
            if until is not None and time.monotonic() >= until:
                raise RuntimeError("Operation timed out!")
            time.sleep(0.01)
        return True


class NcclLazyInitFake:
    """A receiver's group whose first collective call blocks until every rank came, as NCCL's does: NCCL
    creates the communicator inside the first collective (``ncclCommInitRank`` returns once all ranks
    joined). Here that init is a real gloo barrier with the peers, so a peer that never joins holds the call
    until gloo's own timeout (or until the peer's group closes). Later calls are the real gloo ones."""

    def __init__(self, pg) -> None:
        self._pg, self.initialized = pg, False
        #: set when the first call entered its init
        self.entered = threading.Event()

    def broadcast(self, tensor, src):
        if not self.initialized:
            self.entered.set()
            self._pg.barrier().wait()  # every rank must come: a peer that never does holds this call
            self.initialized = True
        return self._pg.broadcast(tensor, src)

    def abort(self) -> None:
        """NCCL's abort of a communicator being set up; gloo has none: the barrier ends when the peer closes."""

    def __getattr__(self, name):
        return getattr(self._pg, name)
