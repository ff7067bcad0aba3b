"""A launch of servers alone (an engine node's `megarl launch` under torchrun on several nodes) stops its servers
at once on a stop signal: no trainer of its own to hold the stop for (megarl/launch/runner.py)."""
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_stop_ends_a_launch_of_servers_alone_at_once(tmp_path):
    ready = tmp_path / "engine.ready"
    engine = (f"import signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n"
              f"open({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    driver = textwrap.dedent(f"""
        import sys
        from megarl.launch.role_commands import RoleCommand
        from megarl.launch.runner import run_commands
        sys.exit(run_commands([RoleCommand("engine0", "engine", "", (sys.executable, "-c", {engine!r}), True)],
                              poll_s=0.05, stop_grace_s=90))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)  # before: held for stop_grace_s + 60 s waiting for a trainer it does not run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 75 and time.monotonic() - t0 < 20
