"""The in-process engine backends by name (``rollout.backend``, ``megarl engine --backend``).

The HF engine's module (torch) is imported only when it is chosen, and the vLLM
engine imports vLLM only when it starts, so the HTTP server and the CLI that
name a backend stay light until they start one.
"""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.platform.cpu_affinity import pin_process
from megarl.rollout.base import BACKENDS, Engine
from megarl.rollout.vllm_engine import VLLMEngine


async def make_engine(backend: str, checkpoint: str, *, cpu_cores: list[int] | None = None, **options) -> Engine:
    """Build an in-process engine; ``options`` go to the backend's ``create``. With ``cpu_cores`` this
    process (and every process vLLM starts from it) is pinned to those cores first (megarl/platform/cpu_affinity.py)."""
    if cpu_cores:
        pin_process(cpu_cores)
    if backend == "vllm":
        engine = await VLLMEngine.create(checkpoint, cpu_cores=cpu_cores, **options)
    elif backend == "hf":
        from megarl.rollout.hf_engine import HFEngine  # lazy: torch

        engine = await HFEngine.create(checkpoint, **options)
    else:
        raise ConfigError(f"unknown engine backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    engine.cpu_cores = sorted(cpu_cores) if cpu_cores else None  # reported by /health
    return engine
