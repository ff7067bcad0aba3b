"""The in-process engine backends by name (``rollout.backend``, ``megarl engine --backend``).

The HF engine's module (torch) is imported only when it is chosen, and the vLLM
engine imports vLLM only when it starts, so the HTTP server and the CLI that
name a backend stay light until they start one.
"""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.rollout.base import BACKENDS, Engine
from megarl.rollout.vllm_engine import VLLMEngine


async def make_engine(backend: str, checkpoint: str, **options) -> Engine:
    """Build an in-process engine; ``options`` go to the backend's ``create``."""
    if backend == "vllm":
        return await VLLMEngine.create(checkpoint, **options)
    if backend == "hf":
        from megarl.rollout.hf_engine import HFEngine  # lazy: torch

        return await HFEngine.create(checkpoint, **options)
    raise ConfigError(f"unknown engine backend {backend!r}; choose one of {', '.join(BACKENDS)}")
