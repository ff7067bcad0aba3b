"""How megarl starts a vLLM engine on CPU: the environment of vLLM's processes and the engine arguments that
differ from vLLM's defaults there (megarl/rollout/vllm_start.py applies them).

- fp32 (set by the engine), eager mode, and ``TORCHDYNAMO_DISABLE=1`` (unless set) for vLLM's processes: the one
  thing left to compile is vLLM's logprob-rank helper, whose first call otherwise costs ~20 s of C++
  compilation per engine process.
- No thread pinning (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set): vLLM's default pins every CPU engine's
  threads to the same cores (core 0 on a 2-core machine), so several engines on one machine queue on one core
  while the others idle. With ``cpu_cores`` the workers' threads are bound to those cores instead.
- The KV cache (``kv_cache_gib``) and the threads (``cpu_threads``) go to vLLM's processes as
  VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS: without the first, vLLM reserves ~92% of the node's memory and
  fails to start when other processes hold some.
- No chunked prefill: vLLM's CPU worker cannot rewind a CPU generator, and a seeded request whose prefill is
  split over two scheduler steps kills the engine ("CPU Generator does not use offset"). A prompt is then
  scheduled whole, so the step budget must hold the longest one.
- One worker and no thread binding: the worker runs inside vLLM's engine-core process (its ``uni`` executor,
  which vLLM takes on CPU only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in that process). vLLM's default on
  CPU is a worker process of its own, one more process that imports vLLM: the engine starts ~7 s sooner
  without it (20.9 s -> 13.9 s for the tiny model on a 2-core machine, the same tokens and log-probs). Bound
  threads (``cpu_cores``) and tensor-parallel workers keep vLLM's worker processes, where vLLM sets up OpenMP
  before anything else runs.
"""
from __future__ import annotations

import os

from megarl.platform.cpu_affinity import omp_bind

#: tokens one scheduler step may process on a CPU engine (vLLM's default budget)
CPU_STEP_TOKENS = 2048


def cpu_engine_setup(*, max_model_len: int, tensor_parallel_size: int, cpu_cores: list[int] | None,
                     kv_cache_gib: int | None, cpu_threads: int | None) -> tuple[dict[str, str], dict]:
    """The environment of a CPU engine's vLLM processes and its engine arguments (module doc)."""
    bind = omp_bind(cpu_cores, tensor_parallel_size) if cpu_cores else None
    env = {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if cpu_threads:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    kwargs = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_STEP_TOKENS)}
    if tensor_parallel_size == 1 and not bind:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    return env, kwargs
