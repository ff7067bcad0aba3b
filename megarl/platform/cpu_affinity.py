"""Roles on disjoint CPU cores (``placement.cpu_affinity``): the trainer on some cores, the engines on others.

On a CPU machine the trainer and the rollout engines otherwise share every
core, so a measurement of asynchrony measures core contention as much as the
design. With ``placement.cpu_affinity.trainer`` the trainer process pins
itself (every thread, and the ones it starts later) and sizes torch's thread
pool to its cores; with ``placement.cpu_affinity.engines`` every engine megarl
starts pins itself before it loads anything, so vLLM's engine-core and worker
processes, which it starts afterwards, inherit the same cores (checked by
tests/e2e/test_vllm_engine.py), and it runs one thread per core. Reward and
tool workers and the dedicated scorer are not given cores: worker processes
get back every core the trainer had before it pinned itself
(:func:`release`), the scorer shares the trainer's.

Linux only (``os.sched_setaffinity``); an empty list leaves that role unpinned.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

from megarl.errors import ConfigError

#: the cores this process could use before :func:`pin_process` narrowed them (None: never pinned)
_UNPINNED: frozenset[int] | None = None


def available_cores() -> set[int]:
    """The cores this process may run on (before any pinning by megarl)."""
    return set(_UNPINNED) if _UNPINNED is not None else set(os.sched_getaffinity(0))


def machine_cores() -> set[int]:
    """Every core of the machine (whether or not this process may run on it)."""
    return set(range(os.cpu_count() or 1))


def parse_cores(text: str, what: str = "cores") -> list[int]:
    """``"0-3,6"`` -> [0, 1, 2, 3, 6] (Linux cpulist syntax); ConfigError naming ``what`` on bad input."""
    cores: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if last < first:
                raise ValueError(part)
            cores += range(first, last + 1)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not a core list; write it like 0-3,6") from None
    return cores


def format_cores(cores: Iterable[int]) -> str:
    """[0, 1, 2, 3, 6] -> ``"0-3,6"``."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_cores(cores: list[int], key: str, available: set[int] | None = None) -> None:
    """ConfigError unless ``cores`` are distinct cores this process may use."""
    available = available_cores() if available is None else available
    if len(set(cores)) != len(cores):
        raise ConfigError(f"{key}={cores} names a core twice; list each core once")
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError(f"{key}={cores}: core(s) {format_cores(missing)} are not available to this process "
                          f"(available: {format_cores(available)}); choose among those")


def check_affinity(affinity, available: set[int] | None = None) -> None:
    """Validate ``placement.cpu_affinity`` (a :class:`~megarl.config.schema.CpuAffinityConfig`) on this machine."""
    check_cores(list(affinity.trainer), "placement.cpu_affinity.trainer", available)
    check_cores(list(affinity.engines), "placement.cpu_affinity.engines", available)


def pin_process(cores: list[int]) -> None:
    """Run this process, every thread it has and every thread and child it starts later, on ``cores`` only;
    torch (if loaded) then uses one intra-op thread per core. ConfigError when a core cannot be used. A
    process may move itself to cores outside the set it inherited (an engine started by a pinned trainer)."""
    global _UNPINNED
    before = frozenset(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:  # a core outside this machine's (or this container's) cpuset
        raise ConfigError(f"cannot run on core(s) {format_cores(cores)}: {e}; this process may use "
                          f"{format_cores(before)}") from e
    if _UNPINNED is None:
        _UNPINNED = before
    for task in Path("/proc/self/task").iterdir():  # sched_setaffinity(0) pins the calling thread only
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    torch = sys.modules.get("torch")  # only if loaded: an engine server pins itself before importing torch
    if torch is not None:
        torch.set_num_threads(len(cores))


def release(pid: int) -> None:
    """Let process ``pid`` (a worker this process just started) run on the cores this process had before
    it pinned itself; nothing when it never did."""
    if _UNPINNED is not None:
        try:
            os.sched_setaffinity(pid, _UNPINNED)
        except ProcessLookupError:  # already gone; its caller sees that
            pass


def omp_bind(cores: list[int], tensor_parallel: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a vLLM CPU engine on ``cores``: its workers' core lists joined by
    ``|`` (the cores split evenly over the tensor-parallel workers), or ``nobind`` when they do not split
    evenly (the workers then inherit the engine's pinning and share its cores)."""
    if not cores or len(cores) % tensor_parallel:
        return "nobind"
    per = len(cores) // tensor_parallel
    ordered = sorted(cores)
    return "|".join(format_cores(ordered[i * per:(i + 1) * per]) for i in range(tensor_parallel))
