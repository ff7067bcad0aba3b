"""Start the commands of a plan and supervise them.

Servers (engines, dedicated scorer) start first, then the trainer. When the
trainer exits the servers are stopped and its exit code is returned; when a
server dies first the others are stopped and the run fails. The dedicated
scorer is the exception when it exits with 0: it does that when the trainer
tells it to stop, at the end of training, while the trainer is still finishing.

SIGTERM (a scheduler's warning before preemption or the time limit) goes on to
the trainer only: it checkpoints and exits with code 75 (megarl/run_stop.py),
which is returned; the servers it still needs until then are stopped after it.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time


def _stop(procs: list[tuple[object, subprocess.Popen]], grace_s: float = 30.0) -> None:
    for _, p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_commands(commands: list, *, poll_s: float = 0.5) -> int:
    """Run RoleCommands (servers first); returns the trainer's exit code (or the first failure's)."""
    ordered = sorted(commands, key=lambda c: not c.server)
    procs: list[tuple[object, subprocess.Popen]] = []

    def forward_term(signum, frame) -> None:
        print("[megarl launch] SIGTERM: the trainer checkpoints and stops", file=sys.stderr, flush=True)
        for c, p in procs:
            if not c.server and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward_term)
    try:
        for c in ordered:
            print(f"[megarl launch] starting {c.name}: {c.shell()}", file=sys.stderr, flush=True)
            procs.append((c, subprocess.Popen(list(c.argv))))
        trainers = [(c, p) for c, p in procs if not c.server]
        while True:
            for c, p in procs:
                rc = p.poll()
                if rc is None:
                    continue
                if c.server and trainers and not (c.role == "dedicated" and rc == 0):
                    print(f"[megarl launch] {c.name} exited with {rc} before the trainer finished; stopping the run",
                          file=sys.stderr, flush=True)
                    _stop(procs)
                    return rc or 1
                if not c.server and rc != 0:
                    print(f"[megarl launch] {c.name} failed with exit code {rc}; stopping the run",
                          file=sys.stderr, flush=True)
                    _stop(procs)
                    return rc
            if trainers and all(p.poll() is not None for _, p in trainers):
                _stop(procs)
                return 0
            if not trainers and all(p.poll() is not None for _, p in procs):
                return max((p.returncode for _, p in procs), default=0)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
