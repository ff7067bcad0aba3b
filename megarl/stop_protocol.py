"""The stop protocol every process of a run shares: the stop signals, the stop budget and the stop marker.

* **Stop signals** (:data:`STOP_SIGNALS`): SIGTERM (a scheduler's warning, a
  preemption, torchrun forwarding one), SIGUSR1 (what `megarl launch` and
  launch/slurm.sbatch send to the trainer ranks, because srun and mpirun turn
  a SIGTERM into a kill) and SIGINT (Ctrl-C). Every trainer rank catches them;
  a repeated one is logged and changes nothing (torchrun and Slurm may deliver
  the same stop twice), so only SIGKILL ends a stopping rank at once.
* **The early latch** (:data:`early_stop`): from the entry point's first lines
  until the loop takes the signals over (megarl/loop/run_stop.py), a stop signal
  is only recorded; the run checks it between its start-up phases (preflight,
  engine start and model load, resume restore) and exits with
  :data:`EXIT_STOPPED` before the next phase begins, so nothing is left half
  written and the job requeues. It imports only the standard library and
  megarl/errors.py: it is installed before torch is imported.
* **The stop budget** (:data:`stop_budget`, ``logging.stop_grace_s``): from
  the first stop signal on, every wait on the way out (the dedicated scorer's
  state, an engine restart at close, engine shutdown) is bounded by what is
  left of it (:meth:`StopBudget.bound`); a wait cut short says so in one line
  (:meth:`StopBudget.unfinished`), and the newest complete checkpoint stands.
* **The stop marker** (``MEGARL_STOP_MARKER``): `megarl launch` names a file
  in the trainer's environment; trainer rank 0 writes it (JSON, by a rename)
  once the run stopped on a signal, after its checkpoint is on disk. The
  launcher then exits with 75 whatever torchrun, srun or mpirun reported.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from megarl.errors import ConfigError, TrainingError
from megarl.isolation.run_key import sign, signed_by
from megarl.isolation.secret_env import STOP_KEY_ENV, take_secret

log = logging.getLogger("megarl.stop")

#: exit code of a run stopped by a stop signal (sysexits' EX_TEMPFAIL): resume it, requeue the job
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_MARKER_ENV = "MEGARL_STOP_MARKER"
#: logging.stop_grace_s's default (megarl/config/schema.py)
DEFAULT_STOP_GRACE_S = 90.0


class RunStopped(TrainingError):
    """The run was asked to stop (a signal) and stopped cleanly: the step it reached checkpointed, or, before
    the loop, nothing new written; ``--resume`` (or the same command again) continues it."""

    exit_code = EXIT_STOPPED


class StopBudget:
    """The seconds a stopping process has left (module doc); one per process (:data:`stop_budget`)."""

    def __init__(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self._deadline: float | None = None
        self.cut_short: list[str] = []

    def configure(self, grace_s: float) -> None:
        if not grace_s > 0:
            raise ConfigError(f"logging.stop_grace_s={grace_s} must be > 0: the seconds a stopped run may take to "
                              f"checkpoint (e.g. logging.stop_grace_s={DEFAULT_STOP_GRACE_S:g})")
        self.grace_s = float(grace_s)

    def start(self) -> None:
        """The first stop signal arrived: the budget runs from now (later calls change nothing)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.grace_s

    @property
    def started(self) -> bool:
        return self._deadline is not None

    def remaining(self) -> float | None:
        """Seconds left of the budget; None while no stop was asked for."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def bound(self, timeout_s: float) -> float:
        """``timeout_s``, or what is left of the budget when a stop is under way and that is shorter."""
        left = self.remaining()
        return timeout_s if left is None else min(timeout_s, left)

    def unfinished(self, what: str) -> None:
        """Report, in one line, a wait of the stop path cut short by the budget."""
        self.cut_short.append(what)
        log.warning("stop: %s did not finish within logging.stop_grace_s=%g s; left as it is", what, self.grace_s)

    def reset(self) -> None:
        """Back to a new process's budget: no stop asked for, nothing cut short, the default grace."""
        self._deadline = None
        self.cut_short = []
        self.grace_s = DEFAULT_STOP_GRACE_S


stop_budget = StopBudget()


class SignalLatch:
    """Records the first stop signal with plain ``signal.signal`` handlers (no event loop needed)."""

    def __init__(self) -> None:
        self.received: str | None = None

    def on_signal(self, signum: int, frame=None) -> None:
        name = signal.Signals(signum).name
        stop_budget.start()
        if self.received is None:
            self.received = name
            log.warning("%s: stopping before the next phase (exit code %d, or 0 if the last step ends first)", name,
                        EXIT_STOPPED)
        else:
            log.warning("%s: already stopping (%s)", name, self.received)

    def install(self) -> bool:
        """Catch the stop signals from now on; False (nothing done) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for s in STOP_SIGNALS:
            signal.signal(s, self.on_signal)
        return True

    @contextmanager
    def installed(self) -> Iterator["SignalLatch"]:
        """While inside, stop signals are latched; the previous handlers come back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.install()
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def reset(self) -> None:
        self.received = None


early_stop = SignalLatch()


def stop_marker_path(env=None) -> Path | None:
    value = (os.environ if env is None else env).get(STOP_MARKER_ENV, "")
    return Path(value) if value else None


def write_stop_marker(reason: str, step: int, checkpointed: bool, env=None, *,
                      checkpoint: str | None = None) -> Path | None:
    """Write the stop marker `megarl launch` named (none named: nothing); call it after the checkpoint.
    ``checkpoint``: the newest complete checkpoint, the one a resume takes (the step's own, or an earlier one
    when the step's failed). Signed with the launch's stop key (megarl/isolation/run_key.py) when this process holds
    one."""
    path = stop_marker_path(env)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    info = {"signal": reason, "step": step, "checkpointed": checkpointed, "checkpoint": checkpoint,
            "cut_short": list(stop_budget.cut_short)}
    key = _stop_key()
    tmp.write_text(json.dumps(sign(info, key) if key else info) + "\n")
    os.replace(tmp, path)
    return path


def read_stop_marker(path: Path) -> dict | None:
    """The marker's content; None when there is none, it is not complete JSON, or this process holds the launch's
    stop key and the marker is not signed with it (written by anything but the run's trainer: not trusted)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    key = _stop_key()
    if not isinstance(info, dict) or (key and not signed_by(info, key)):
        log.warning("%s is not a stop marker signed by this launch's trainer: ignored", path)
        return None
    return info


def _stop_key() -> bytes:
    return take_secret(STOP_KEY_ENV).encode()
