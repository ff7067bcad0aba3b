"""RewardService: score trajectories in worker processes, off the critical path.

The controller awaits ``score`` while generation and training go on; the
reward function runs in one of ``n_workers`` worker processes. A reward
that raises, hangs past ``timeout_s``, exceeds ``memory_mb`` or kills its
process marks that one sample failed and never stops the run: the outcome says
so, the reason is logged, ``stats`` counts it, and a hung or dead worker is
killed and replaced.

``on_failure`` says what a failed sample becomes:
- ``"zero"``: ``RewardOutcome(reward=0.0, failed=True, drop=False)``, trained on
  with reward 0 (the sample stays in its group);
- ``"drop"``: ``RewardOutcome(reward=nan, failed=True, drop=True)``; the
  controller must drop the sample (NaN makes forgetting to do so loud).

Workers are fresh interpreters (see ``worker.py``), never forks of the
trainer's or engine's process with its threads and CUDA state. Waiting uses
``loop.add_reader``, so it needs a Unix selector event loop (the asyncio
default on Linux). Call ``score`` from one event loop at a time; it is not
thread-safe. A worker's first call also waits for it to start (the reward's
imports); ``timeout_s`` counts only the reward call itself.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from megarl.errors import ConfigError
from megarl.rewards import resolve_reward_fn, reward_kwargs
from megarl.types import RewardInput

logger = logging.getLogger(__name__)

ON_FAILURE = ("zero", "drop")
# the directory holding the megarl package, so a worker finds it from any cwd
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a new worker imports the reward (math-verify pulls in sympy) before it is ready
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RewardOutcome:
    """The reward of one sample, or why there is none."""

    reward: float
    failed: bool = False
    reason: str | None = None
    #: True when on_failure="drop": the controller must not train on this sample.
    drop: bool = False


class _Worker:
    """One worker process (``python -c`` running :func:`worker.main`) and the parent's end of its socket."""

    def __init__(self, config: tuple) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        boot = f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); from megarl.rewards.worker import main; main({fd})"
        self.proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[fd], stdin=subprocess.DEVNULL)
        child_sock.close()  # so the worker's death shows here as EOF
        self.conn = Connection(parent_sock.detach())
        self.conn.send(config)
        self.ready = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel; it goes when it can
            logger.error("reward worker %d did not die within 5 s of SIGKILL", self.proc.pid)
        self.conn.close()

    def exit_info(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"worker exited with code {code}"


class RewardService:
    """A pool of reward worker processes behind ``async score(RewardInput)``."""

    def __init__(self, fn: str, n_workers: int = 2, timeout_s: float = 5.0, memory_mb: int | None = 512,
                 on_failure: str = "zero") -> None:
        if on_failure not in ON_FAILURE:
            raise ConfigError(f"on_failure={on_failure!r}; choose one of {list(ON_FAILURE)}")
        if n_workers < 1 or timeout_s <= 0 or (memory_mb is not None and memory_mb <= 0):
            raise ConfigError(f"RewardService needs n_workers >= 1, timeout_s > 0, memory_mb > 0 or None; "
                              f"got {n_workers}, {timeout_s}, {memory_mb}")
        # import and check here, before any worker starts: a bad path or signature is a ConfigError before the run
        reward_kwargs(resolve_reward_fn(fn), fn)
        self.fn, self.timeout_s, self.memory_mb, self.on_failure = fn, timeout_s, memory_mb, on_failure
        self.stats = {"n_ok": 0, "n_failed_raise": 0, "n_failed_timeout": 0, "n_failed_memory": 0,
                      "n_failed_crash": 0}
        self._config = (fn, memory_mb, list(sys.path))
        self._idle = [_Worker(self._config) for _ in range(n_workers)]
        self._busy: set[_Worker] = set()
        self._n_workers = n_workers
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._closed = False

    # -- public --------------------------------------------------------------------
    async def score(self, sample: RewardInput) -> RewardOutcome:
        """The reward of one response; never raises for a failing reward function."""
        if self._closed:
            raise RuntimeError("RewardService is closed")
        async with self._semaphore():
            worker = self._idle.pop()
            self._busy.add(worker)
            returned: _Worker | None = None
            try:
                kind, value, returned = await self._call(worker, (sample.response, sample.answer, sample.info()))
            except BaseException:  # cancelled mid-call: the worker's state is unknown
                worker.kill()
                returned = None if self._closed else _Worker(self._config)
                raise
            finally:
                self._busy.discard(worker)
                if returned is not None:
                    if self._closed:  # close() ran during the call
                        returned.kill()
                    else:
                        self._idle.append(returned)
        return self._outcome(kind, value)

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in [*self._idle, *self._busy]:
            w.kill()
        self._idle.clear()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        # one per event loop: a service built outside asyncio.run may serve several loops
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self._n_workers))
        return self._slots[1]

    async def _recv(self, worker: _Worker, timeout: float) -> Any:
        """The worker's next message; TimeoutError after ``timeout``; EOFError if it died."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(fd)
        return worker.conn.recv()

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        return _Worker(self._config)

    async def _call(self, worker: _Worker, request: tuple) -> tuple[str, str | float, _Worker]:
        """Run one request: ``(kind, reward or reason, the worker to put back)``."""
        if not worker.ready:
            try:
                kind, msg = await self._recv(worker, STARTUP_TIMEOUT_S)
            except (EOFError, OSError, asyncio.TimeoutError) as e:
                kind, msg = "crash", f"{type(e).__name__}: {worker.exit_info()}"
            if kind != "ready":
                return "crash", f"reward worker failed to start: {msg}", self._replace(worker)
            worker.ready = True
        try:
            worker.conn.send(request)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            return "raise", f"cannot send the sample to the worker: {type(e).__name__}: {e}", worker
        except OSError as e:
            return "crash", f"{type(e).__name__}: {worker.exit_info()}", self._replace(worker)
        try:
            kind, value = await self._recv(worker, self.timeout_s)
        except asyncio.TimeoutError:
            return "timeout", f"reward took longer than timeout_s={self.timeout_s}", self._replace(worker)
        except (EOFError, OSError):
            return "crash", worker.exit_info(), self._replace(worker)
        if kind == "memory":
            return kind, value, self._replace(worker)
        return kind, value, worker

    def _outcome(self, kind: str, value: str | float) -> RewardOutcome:
        if kind == "ok":
            self.stats["n_ok"] += 1
            return RewardOutcome(reward=float(value))
        self.stats[f"n_failed_{kind}"] += 1
        logger.warning("reward %r failed (%s): %s", self.fn, kind, value)
        reason = f"{kind}: {value}"
        if self.on_failure == "drop":
            return RewardOutcome(reward=math.nan, failed=True, reason=reason, drop=True)
        return RewardOutcome(reward=0.0, failed=True, reason=reason)
