"""WorkerPool: run user code in worker processes with a time limit, a memory limit and crash containment.

A call that raises, hangs past ``timeout_s``, exceeds ``memory_mb`` or kills
its process comes back as ``(kind, message)`` with kind ``raise``, ``timeout``,
``memory`` or ``crash``, never as an exception; a hung or dead worker is
killed and replaced. A successful call comes back as ``("ok", value)``.

Workers are fresh interpreters (see ``process.py``), never forks of the
trainer's or engine's process with its threads and CUDA state, and they
start without the run's secrets in their environment (megarl/isolation/secret_env.py):
user code runs there. What a worker
runs is set by its ``mode`` (``process.HANDLERS``) and ``target``. Waiting
uses ``loop.add_reader``, so it needs a Unix selector event loop (the asyncio
default on Linux). Call ``call`` from one event loop at a time; it is not
thread-safe. A worker's first call also waits for it to start (the target's
imports); ``timeout_s`` counts only the call itself.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from megarl.errors import ConfigError
from megarl.isolation.secret_env import user_code_env
from megarl.platform.cpu_affinity import release

logger = logging.getLogger(__name__)

# the directory holding the megarl package, so a worker finds it from any cwd
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a new worker imports its target (math-verify pulls in sympy) before it is ready
STARTUP_TIMEOUT_S = 120.0
FAILURE_KINDS = ("raise", "timeout", "memory", "crash")


class _Worker:
    """One worker process (``python -c`` running :func:`process.main`) and the parent's end of its socket."""

    def __init__(self, config: tuple) -> None:
        parent_sock, child_sock = socket.socketpair()
        fd = child_sock.fileno()
        boot = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
                f"from megarl.workers.process import main; main({fd})")
        self.proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[fd], stdin=subprocess.DEVNULL,
                                     env=user_code_env(keep_megarl=True))
        release(self.proc.pid)  # a pinned trainer's workers may run on any core (megarl/platform/cpu_affinity.py)
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
            logger.error("worker %d did not die within 5 s of SIGKILL", self.proc.pid)
        self.conn.close()

    def exit_info(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"worker exited with code {code}"


class WorkerPool:
    """``n_workers`` worker processes behind ``async call(payload) -> (kind, value)``."""

    def __init__(self, mode: str, target: Any, *, n_workers: int, timeout_s: float, memory_mb: int | None,
                 label: str) -> None:
        if n_workers < 1 or timeout_s <= 0 or (memory_mb is not None and memory_mb <= 0):
            raise ConfigError(f"{label} needs n_workers >= 1, timeout_s > 0, memory_mb > 0 or None; "
                              f"got {n_workers}, {timeout_s}, {memory_mb}")
        self.timeout_s, self.memory_mb, self.label = timeout_s, memory_mb, label
        self._config = (mode, target, memory_mb, list(sys.path))
        self._idle = [_Worker(self._config) for _ in range(n_workers)]
        self._busy: set[_Worker] = set()
        self._n_workers = n_workers
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.closed = False

    async def call(self, payload: Any) -> tuple[str, Any]:
        """Run ``payload`` in a worker: ``("ok", value)`` or ``(failure kind, message)``."""
        if self.closed:
            raise RuntimeError(f"{self.label} is closed")
        async with self._semaphore():
            worker = self._idle.pop()
            self._busy.add(worker)
            returned: _Worker | None = None
            try:
                kind, value, returned = await self._call(worker, payload)
            except BaseException:  # cancelled mid-call: the worker's state is unknown
                worker.kill()
                returned = None if self.closed else _Worker(self._config)
                raise
            finally:
                self._busy.discard(worker)
                if returned is not None:
                    if self.closed:  # close() ran during the call
                        returned.kill()
                    else:
                        self._idle.append(returned)
        return kind, value

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for w in [*self._idle, *self._busy]:
            w.kill()
        self._idle.clear()

    # -- internals -------------------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        # one per event loop: a pool built outside asyncio.run may serve several loops
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

    async def _call(self, worker: _Worker, payload: Any) -> tuple[str, Any, _Worker]:
        """Run one request: ``(kind, value or reason, the worker to put back)``."""
        if not worker.ready:
            try:
                kind, msg = await self._recv(worker, STARTUP_TIMEOUT_S)
            except (EOFError, OSError, asyncio.TimeoutError) as e:
                kind, msg = "crash", f"{type(e).__name__}: {worker.exit_info()}"
            if kind != "ready":
                return "crash", f"worker failed to start: {msg}", self._replace(worker)
            worker.ready = True
        try:
            worker.conn.send(payload)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            return "raise", f"cannot send the call to the worker: {type(e).__name__}: {e}", worker
        except OSError as e:
            return "crash", f"{type(e).__name__}: {worker.exit_info()}", self._replace(worker)
        try:
            kind, value = await self._recv(worker, self.timeout_s)
        except asyncio.TimeoutError:
            return "timeout", f"took longer than timeout_s={self.timeout_s}", self._replace(worker)
        except (EOFError, OSError):
            return "crash", worker.exit_info(), self._replace(worker)
        if kind == "memory":
            return kind, value, self._replace(worker)
        return kind, value, worker
