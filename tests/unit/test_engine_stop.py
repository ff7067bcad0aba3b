"""Stopping an engine process at the end of a run: at once, and nothing of its group is left behind."""
import subprocess
import sys
import time
from pathlib import Path

from megarl.rollout.client import stop_engine_process

# a stand-in server: exits on SIGTERM after 3 s (an orderly shutdown), leaving a child that ignores
# SIGTERM (an engine-core process that would outlive it)
SERVER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
child.stdout.readline()
signal.signal(signal.SIGTERM, lambda *a: (time.sleep(3.0), sys.exit(0)))
print(child.pid, flush=True)
time.sleep(60)
"""


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_stop_without_waiting_returns_at_once_and_the_group_is_reaped():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    assert stop_engine_process(proc, timeout_s=10.0, wait=False) is None
    assert proc.poll() is None  # returned while the server is still in its orderly shutdown: not waited for
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not (proc.poll() is not None and gone(child)):
        time.sleep(0.1)
    assert proc.returncode == 0  # its shutdown ran to the end
    assert gone(child)  # the child ignoring SIGTERM was SIGKILLed with the group after the server exited


def test_stop_waiting_returns_the_exit_code():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    assert stop_engine_process(proc, timeout_s=10.0) == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not gone(child):
        time.sleep(0.1)
    assert gone(child)
