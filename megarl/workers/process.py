"""The loop of one worker process (started by megarl.workers.pool.WorkerPool).

The worker is a fresh interpreter (``python -c`` calling :func:`main`) that
talks to the pool over a socket wrapped in a
``multiprocessing.connection.Connection``. Not ``multiprocessing``'s own
'spawn': that re-imports the launcher's ``__main__`` in every worker (an
unguarded script runs again; torch and Megatron would load into each worker
and into its memory budget).

Protocol. Parent -> worker first: ``(mode, target, memory_mb, sys_path)``.
Worker -> parent: ``("ready", None)`` or ``("setup_error", msg)``. Then per
request (a payload of the mode, :data:`HANDLERS`) it answers ``("ok", value)``,
``("raise", msg)`` or ``("memory", msg)``; ``None`` asks it to exit. Hangs and
crashes are the parent's to detect (timeout, EOF).

Modes:
- ``reward``: target = a reward name or dotted path; payload
  ``(response, answer, info)`` (megarl.types.RewardInput); value = the reward (a finite float).
- ``tool``: target = ``{tool name: dotted path}``; payload ``(name, arguments)``;
  value = the tool's result as a string (megarl/agents/tools.py).
"""
from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

from megarl.rewards import resolve_reward_fn, reward_kwargs


def _address_space_bytes() -> int:
    """Current virtual memory size (what RLIMIT_AS limits); 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def _die_with_parent() -> None:
    """A worker stuck in a reward must not outlive the service (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _reward_handler(name: str) -> Callable[[tuple], float]:
    fn = resolve_reward_fn(name)
    takes = reward_kwargs(fn, name)  # None: every info key

    def handle(request: tuple) -> float:
        response, answer, info = request
        kwargs = info if takes is None else {k: info[k] for k in takes}
        reward = float(fn(response, answer, **kwargs))
        if not math.isfinite(reward):
            raise ValueError(f"reward function returned {reward}")
        return reward
    return handle


def _tool_handler(paths: dict[str, str]) -> Callable[[tuple], str]:
    tools = {name: resolve_reward_fn(path) for name, path in paths.items()}

    def handle(request: tuple) -> str:
        name, arguments = request
        return str(tools[name](**arguments))
    return handle


#: mode -> (target -> the function that serves one request)
HANDLERS: dict[str, Callable[[Any], Callable[[Any], Any]]] = {"reward": _reward_handler, "tool": _tool_handler}


def main(fd: int) -> None:
    """Serve requests on the socket ``fd`` until told to stop or the parent goes."""
    # Ctrl-C and a run's stop signals (megarl/stop_protocol.py: a Slurm step's or a process group's SIGUSR1 /
    # SIGTERM) reach every process of the run; the service decides when workers stop (it kills them with
    # SIGKILL, and PR_SET_PDEATHSIG ends them with it), so a call in flight is not failed by the stop.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    conn = Connection(fd)
    try:
        mode, target, memory_mb, sys_path = conn.recv()
    except (EOFError, OSError):
        return
    # the parent's path, so user code in a directory it added (tests, scripts) imports here too
    sys.path[:] = sys_path
    try:
        handle = HANDLERS[mode](target)
        if memory_mb is not None:
            # The budget is on top of the idle worker (interpreter and the
            # target's own imports, e.g. sympy), so memory_mb is what one call
            # may allocate. Soft limit only: the code sandbox sets its
            # own limit for its subprocess.
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            soft = _address_space_bytes() + (memory_mb << 20)
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except BaseException as e:  # report anything, the parent counts it as a crash
        conn.send(("setup_error", _describe(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if request is None:
            return
        try:
            reply = ("ok", handle(request))
        except MemoryError as e:
            reply = ("memory", _describe(e) if str(e) else f"MemoryError (over memory_mb={memory_mb})")
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the sample fails, the worker lives
            reply = ("raise", _describe(e))
        conn.send(reply)
        if reply[0] == "memory":
            return  # a fresh worker replaces one that ran out of memory: its heap may be fragmented
