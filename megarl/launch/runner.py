"""Start the commands of a plan and supervise them.

Servers (engines, dedicated scorer) start first, then the trainer. When the
trainer exits the servers are stopped and its exit code is returned; when a
server dies first the others are stopped and the run fails. The dedicated
scorer is the exception when it exits with 0: it does that when the trainer
tells it to stop, at the end of training, while the trainer is still finishing.

Stops (megarl/stop_protocol.py). A stop signal (SIGTERM, SIGUSR1, SIGINT) to
this command is passed on to the trainer as SIGUSR1, the one signal torchrun
(rendered with it in ``--signals-to-handle`` and a shutdown timeout longer
than ``logging.stop_grace_s``), srun (which turns SIGTERM into a kill of every
task) and mpirun all pass on to the ranks without killing them. A server that
exits with 75, or any server exit once the run is stopping, is part of the
stop, not a failure: the trainer is left to finish its checkpoint (a server
stopped by the same preemption as the trainer). Whatever the launcher itself
reports, the command exits with 75 when trainer rank 0 wrote the stop marker
(after its checkpoint), so a job script can requeue on it.

A stop during this command's own start is latched (``latch_launch_stops``): one
before the trainer started starts nothing more and exits with 75; one while the
trainer starts is held until trainer rank 0 says every rank catches stop
signals (megarl/loop/stop_ready.py), then delivered (``_Stopping``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megarl.isolation.key_files import KeyFiles, child_env
from megarl.launch.role_commands import SHUTDOWN_MARGIN_S, RoleCommand
from megarl.loop.stop_ready import ready_path
from megarl.stop_protocol import EXIT_STOPPED, STOP_SIGNALS, early_stop, read_stop_marker

#: the signal that carries a stop to the trainer's launcher process (module doc)
FORWARD_SIGNAL = signal.SIGUSR1


def stop_marker_for(cfg) -> Path:
    """Where trainer rank 0 writes the stop marker: in the run directory when the config names it (shared by
    every node of a job), else under runs/ with the job's id (or this process's)."""
    base = cfg.logging.resume or cfg.logging.output_dir
    if base:
        return (Path(base) / "stop.json").absolute()
    job = os.environ.get("SLURM_JOB_ID") or str(os.getpid())
    return (Path("runs") / f".megarl-stop-{job}.json").absolute()


def latch_launch_stops() -> None:
    """From the first lines of `megarl launch`: a stop signal is recorded, not fatal, until :func:`run_commands`
    takes it over (the command imports torch and reads the config first)."""
    early_stop.install()


def _stop(procs: list[tuple[RoleCommand, subprocess.Popen]], grace_s: float = 30.0) -> None:
    """End the commands: SIGTERM, but an srun step gets the stop signal srun passes on (it turns SIGTERM into a
    kill of its tasks), so an engine step on another node shuts down as cleanly as a local one."""
    for c, p in procs:
        if p.poll() is None:
            p.send_signal(FORWARD_SIGNAL if c.argv[:1] == ("srun",) else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Stopping:
    """The run's stop: when it began, and its delivery to the trainer processes once they can take it.

    A stop that comes while the trainer starts is held: SIGUSR1 would kill torchrun, or a rank, that has not
    installed its handler yet. It is sent once trainer rank 0 wrote the ready file (megarl/loop/stop_ready.py), to
    every trainer process started by then and to any started after; a trainer that never writes one (not
    megarl's) gets it ``stop_grace_s`` after the stop. A stop before the trainer started starts nothing more."""

    def __init__(self, trainers: list[subprocess.Popen], ready: Path | None, hold_s: float) -> None:
        self.trainers = trainers
        self.ready, self.hold_s = ready, hold_s
        self.since: float | None = None
        self._sent: set[int] = set()
        self._held = False

    def begin(self, why: str) -> None:
        if self.since is None:
            self.since = time.monotonic()
            print(f"[megarl launch] {why}: passing the stop on to the trainer ranks ({FORWARD_SIGNAL.name}); they "
                  f"checkpoint, then the run exits with {EXIT_STOPPED}", file=sys.stderr, flush=True)
        self.deliver()

    def deliver(self) -> None:
        """Send the stop to each running trainer process that has not had it, if the trainer can take it."""
        if self.since is None or not self.trainers:
            return
        if not self._can_take():
            if not self._held:
                self._held = True
                print("[megarl launch] the trainer is starting: the stop is held until it catches stop signals",
                      file=sys.stderr, flush=True)
            return
        for p in self.trainers:
            if p.poll() is None and p.pid not in self._sent:
                self._sent.add(p.pid)
                p.send_signal(FORWARD_SIGNAL)

    def _can_take(self) -> bool:
        return (self.ready is None or self.ready.is_file()
                or time.monotonic() - (self.since or 0.0) >= self.hold_s)


def _stopped_cleanly(marker: Path | None) -> bool:
    info = read_stop_marker(marker) if marker is not None else None
    if info is None:
        return False
    kept = "checkpointed" if info.get("checkpointed") else \
        f"not checkpointed; the newest earlier checkpoint stands: {info.get('checkpoint')}"
    print(f"[megarl launch] the trainer stopped on {info.get('signal')} at step {info.get('step')} ({kept}); "
          f"exit code {EXIT_STOPPED}: resume the run", file=sys.stderr, flush=True)
    marker.unlink(missing_ok=True)
    return True


def run_commands(commands: list, *, poll_s: float = 0.5, stop_marker: Path | None = None,
                 stop_grace_s: float = 90.0, key_files: KeyFiles | None = None) -> int:
    """Run RoleCommands (servers first); returns the trainer's exit code (or the first failure's), 75 for a
    clean stop (module doc). ``stop_marker``: the file the trainer's commands name in MEGARL_STOP_MARKER.
    ``key_files``: the run's keys, written for each command just before it starts (megarl/isolation/key_files.py);
    whatever no reader took is removed when this returns."""
    ordered = sorted(commands, key=lambda c: not c.server)
    procs: list[tuple[RoleCommand, subprocess.Popen]] = []
    ready = ready_path(stop_marker) if stop_marker is not None else None
    for stale in (stop_marker, ready):  # an earlier launch's say nothing about this one
        if stale is not None:
            stale.unlink(missing_ok=True)
    trainer_procs: list[subprocess.Popen] = []
    stopping = _Stopping(trainer_procs, ready, hold_s=stop_grace_s)
    # the trainer's own stop path takes up to stop_grace_s, torchrun waits SHUTDOWN_MARGIN_S more for its workers
    give_up_s = stop_grace_s + 2 * SHUTDOWN_MARGIN_S

    def on_signal(signum, frame) -> None:
        stopping.begin(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        if early_stop.received is not None:  # during this command's own start (latch_launch_stops)
            stopping.begin(early_stop.received)
        for c in ordered:
            if stopping.since is not None and not trainer_procs:  # a stop before the trainer started
                _stop(procs)
                print(f"[megarl launch] stopped before the trainer started: nothing was written; exit code "
                      f"{EXIT_STOPPED} (run the same command again)", file=sys.stderr, flush=True)
                return EXIT_STOPPED
            print(f"[megarl launch] starting {c.name}: {c.shell()}", file=sys.stderr, flush=True)
            p = subprocess.Popen(list(c.argv), env=child_env(c.role, key_files))
            procs.append((c, p))
            if not c.server:
                trainer_procs.append(p)
                stopping.deliver()
        reported: set[str] = set()
        while True:
            stopping.deliver()
            trainers_running = any(p.poll() is None for p in trainer_procs)
            for c, p in procs:
                rc = p.poll()
                if rc is None:
                    continue
                if c.server and trainers_running and not (c.role == "dedicated" and rc == 0):
                    if rc == EXIT_STOPPED or stopping.since is not None:
                        if c.name not in reported:
                            reported.add(c.name)
                            stopping.begin(f"{c.name} stopped (exit code {rc})")
                        continue
                    print(f"[megarl launch] {c.name} exited with {rc} before the trainer finished; stopping the run",
                          file=sys.stderr, flush=True)
                    _stop(procs)
                    return rc or 1
                if not c.server and rc != 0:
                    _stop(procs)
                    if _stopped_cleanly(stop_marker):
                        return EXIT_STOPPED
                    print(f"[megarl launch] {c.name} failed with exit code {rc}; stopping the run",
                          file=sys.stderr, flush=True)
                    return rc
            if trainer_procs and not trainers_running:
                _stop(procs)
                return EXIT_STOPPED if _stopped_cleanly(stop_marker) else 0
            if not trainer_procs and stopping.since is not None:  # servers alone (an engine node's launch under
                _stop(procs)  # torchrun on several nodes): no trainer to hold the stop for, they stop now
                return EXIT_STOPPED
            if not trainer_procs and all(p.poll() is not None for _, p in procs):
                return max((p.returncode for _, p in procs), default=0)
            if stopping.since is not None and time.monotonic() - stopping.since > give_up_s:
                print(f"[megarl launch] the trainer did not stop within {give_up_s:g} s of the stop "
                      f"(logging.stop_grace_s={stop_grace_s:g} + {2 * SHUTDOWN_MARGIN_S} s); killing the run",
                      file=sys.stderr, flush=True)
                _stop(procs, grace_s=5.0)
                return EXIT_STOPPED if _stopped_cleanly(stop_marker) else 1
            time.sleep(poll_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if key_files is not None:
            key_files.close()
