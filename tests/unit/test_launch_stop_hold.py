"""`megarl launch` holds a stop that comes while the trainer starts (megarl/launch/runner.py,
megarl/loop/stop_ready.py).

The trainer here is a stand-in with the one property that matters to the launcher: SIGUSR1 kills it until it has
installed its handler, 1.5 s after it started, and it says so the way trainer rank 0 does (the ready file). The
real `megarl launch --launcher torchrun` at each moment of its start is tests/e2e/test_stop_during_launch.py's.
"""
import sys
import time
from pathlib import Path

from megarl.launch.role_commands import RoleCommand
from megarl.launch.runner import run_commands
from megarl.stop_protocol import EXIT_STOPPED, STOP_MARKER_ENV, early_stop

SLOW_START = ("import pathlib, signal, sys, time\n"
              "time.sleep(1.5)  # importing: a SIGUSR1 now kills it\n"
              "def stop(*_):\n    from megarl.stop_protocol import write_stop_marker\n"
              "    write_stop_marker('SIGUSR1', 0, False); sys.exit(1)\n"
              "signal.signal(signal.SIGUSR1, stop)\n"
              "from megarl.loop.stop_ready import announce_stop_ready\nannounce_stop_ready()\n"
              "time.sleep(60)\n")


def trainer(marker: Path) -> RoleCommand:
    return RoleCommand("trainer", "trainer", "", ("env", f"{STOP_MARKER_ENV}={marker}", sys.executable, "-c",
                                                  SLOW_START), False)


def test_a_stop_while_the_trainer_starts_is_held_until_it_can_take_it(tmp_path):
    """An engine stopped by the same preemption exits 75 at once, while the trainer still imports: the stop reaches
    the trainer once it is ready (before, at once: the trainer died of it, exit -10)."""
    marker = tmp_path / "stop.json"
    engine = RoleCommand("engine0", "engine", "", (sys.executable, "-c", "import sys; sys.exit(75)"), True)
    t0 = time.monotonic()
    assert run_commands([engine, trainer(marker)], poll_s=0.05, stop_marker=marker) == EXIT_STOPPED
    assert 1.5 <= time.monotonic() - t0 < 30
    assert not marker.exists()  # read (the stand-in wrote it on the stop) and removed


def test_a_stop_before_the_trainer_started_starts_nothing_and_exits_75(tmp_path, capfd):
    """A stop latched while `megarl launch` itself started (latch_launch_stops): nothing is started."""
    marker = tmp_path / "stop.json"
    early_stop.received = "SIGUSR1"  # what the latch records (the unit tests' fixture resets it)
    started = tmp_path / "started"
    never = RoleCommand("trainer", "trainer", "", (sys.executable, "-c", f"open({str(started)!r}, 'w')"), False)
    assert run_commands([never], poll_s=0.05, stop_marker=marker) == EXIT_STOPPED
    assert not started.exists()
    assert "stopped before the trainer started: nothing was written" in capfd.readouterr().err
