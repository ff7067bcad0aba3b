"""The flags for an engine's CPU resources, shared by the commands that start one without a run config
(`megarl engine`, `megarl generate`): the same meaning and defaults as rollout.kv_cache_gb,
rollout.kv_block_size and rollout.cpu_threads, so that neither command depends on VLLM_CPU_KVCACHE_SPACE or
OMP_NUM_THREADS."""
from __future__ import annotations

from megarl.config.schema import RolloutConfig
from megarl.platform.cpu_affinity import check_cores, machine_cores, parse_cores
from megarl.rollout.base import engine_options


def add_engine_resource_args(p) -> None:
    defaults = RolloutConfig()
    p.add_argument("--kv-cache-gb", type=int, default=defaults.kv_cache_gb,
                   help=f"vllm on CPU: KV cache in GiB (default {defaults.kv_cache_gb}, as rollout.kv_cache_gb; "
                        f"it replaces $VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--cpu-threads", type=int, default=defaults.cpu_threads,
                   help=f"on CPU: threads of the engine, OMP_NUM_THREADS of vLLM's processes or torch threads of "
                        f"hf (default {defaults.cpu_threads}, as rollout.cpu_threads; 0: the environment's)")
    p.add_argument("--kv-block-size", type=int, default=defaults.kv_block_size,
                   help="vllm: tokens per KV-cache block, the prefix cache's unit (default 0: vLLM's own, 128 on "
                        "CPU; as rollout.kv_block_size)")
    p.add_argument("--cpu-cores", default="", metavar="LIST",
                   help="on CPU: pin the engine (and vLLM's processes) to these cores, e.g. 1 or 2-3, with one "
                        "thread per core (replaces --cpu-threads; as placement.cpu_affinity.engines)")


def engine_resource_options(args) -> dict:
    """``make_engine`` options from the flags of :func:`add_engine_resource_args`."""
    cores = parse_cores(args.cpu_cores, "--cpu-cores") if args.cpu_cores else []
    # against the machine's cores, not this process's: a pinned trainer's engine inherits the trainer's cores
    check_cores(cores, "--cpu-cores", machine_cores())
    return engine_options(args.backend, args.kv_cache_gb, args.cpu_threads, cores, kv_block_size=args.kv_block_size)
