"""A weight broadcaster that fails the way NCCL does, for the broadcast publisher's tests on gloo.

The publisher's sender process is spawned and imports this module by name
(pytest puts tests/unit on sys.path and spawn hands sys.path to the child).
"""
import os
import signal
from pathlib import Path

from megarl.rollout.weight_sync import WeightBroadcaster

#: "<engine pid>:<flag file>": the sender kills that engine after its first bucket, once (the file records it)
KILL_ENV = "MEGARL_TEST_KILL_ENGINE"


class WatchdogBroadcaster(WeightBroadcaster):
    """NCCL's failure semantics on gloo: a collective that fails ends the process, no ``except`` runs.

    NCCL's watchdog calls ``abort()`` on the process holding a communicator whose
    peer was lost; here the process exits with SIGABRT's status, without a core file.
    """

    n_sent = 0

    def send_bucket(self, *bucket):
        self._lose_engine()
        try:
            super().send_bucket(*bucket)
        except Exception:  # noqa: BLE001 - a lost peer: the process goes down as under NCCL
            os._exit(128 + signal.SIGABRT)
        WatchdogBroadcaster.n_sent += 1

    def _lose_engine(self) -> None:
        spec = os.environ.get(KILL_ENV)
        if not spec or WatchdogBroadcaster.n_sent != 1:
            return
        pid, flag = spec.split(":", 1)
        if not Path(flag).exists():
            Path(flag).write_text("killed")
            os.kill(int(pid), signal.SIGKILL)


class HangingBroadcaster(WeightBroadcaster):
    """A collective that never completes (an NCCL wait on a peer that stalled): joining hangs."""

    def connect(self) -> None:
        import time

        time.sleep(3600)
