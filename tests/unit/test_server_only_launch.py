"""A launch of servers alone (an engine node's `megarl launch` under torchrun on several nodes) stops its servers
at once on a stop signal: no trainer of its own to hold the stop for (megarl/launch/runner.py)."""
import os
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


def test_an_srun_step_is_stopped_with_the_signal_srun_passes_on(tmp_path, monkeypatch):
    """srun turns SIGTERM into a kill of its tasks ("forcing job termination"): a step the launch ends gets
    SIGUSR1, which srun passes on, so an engine on another node shuts down cleanly (exit 75)."""
    from megarl.launch.role_commands import RoleCommand
    from megarl.launch.runner import _stop

    fake = tmp_path / "srun"  # records the signal it got, as the engine behind a real srun would see it
    fake.write_text(f"#!{sys.executable}\nimport pathlib, signal, sys, time\n"
                    "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))\n"
                    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(9))\n"
                    "pathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    ready = tmp_path / "ready"
    cmd = RoleCommand("engine0", "engine", "", ("srun", str(ready)), True)
    p = subprocess.Popen(list(cmd.argv))
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _stop([(cmd, p)], grace_s=10)
    assert p.returncode == 75
