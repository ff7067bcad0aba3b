"""Permission for AMX tile state in processes that run bf16 kernels on CPU.

Linux hands out the AMX tile registers only to a process that asked for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); an AMX instruction in a process that
did not ask raises SIGILL. vLLM's CPU attention takes its AMX kernel for bf16
on hosts with AMX and never asks, so a bf16 vLLM CPU engine dies on its first
forward there (exit 132, "Worker proc ... died unexpectedly"). torch's own
bf16 matmuls are unaffected (oneDNN asks by itself), and fp32 never takes the
AMX attention kernel.

``torch._C._cpu._init_amx()`` makes the request; it returns False on a host
without AMX, where there is nothing to ask for. megarl calls it in every engine
process that runs bf16: the serving process, and vLLM's worker processes
through the environment variable :data:`REQUEST_ENV`, which the worker
extension (megarl/rollout/vllm_worker_ext.py) reads when vLLM imports it.
"""
from __future__ import annotations

import os

import torch

#: set to "1" in the environment of a bf16 engine's child processes
REQUEST_ENV = "MEGARL_REQUEST_AMX"


def host_has_amx() -> bool:
    """True when /proc/cpuinfo lists AMX tile support (Linux x86)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def request_amx() -> bool:
    """Ask the kernel for AMX tile state for this process; True when granted (False: no AMX here)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    if init is None:  # torch builds without the helper: nothing megarl can ask through
        return False
    return bool(init())


def request_amx_if_asked() -> bool:
    """:func:`request_amx` when this process's environment carries :data:`REQUEST_ENV` = 1."""
    return os.environ.get(REQUEST_ENV) == "1" and request_amx()
