"""A weight broadcaster that kills a whole engine (its process group: the server and vLLM's engine core) mid-stream.

tests/unit/broadcast_faults.py's WatchdogBroadcaster kills one process; a vLLM
engine's broadcast rank lives in its engine-core child, so losing the engine
means losing the group. The sender process imports this module by name.
"""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from broadcast_faults import KILL_ENV, WatchdogBroadcaster  # noqa: E402


class GroupKillBroadcaster(WatchdogBroadcaster):
    """WatchdogBroadcaster (NCCL's end for the sender) that loses an engine's whole process group."""

    def _lose_engine(self) -> None:
        spec = os.environ.get(KILL_ENV)
        if not spec or WatchdogBroadcaster.n_sent != 1:
            return
        pid, flag = spec.split(":", 1)
        if not Path(flag).exists():
            Path(flag).write_text("killed")
            os.killpg(int(pid), signal.SIGKILL)
