"""GPUs of the engines `megarl train` starts itself on a CUDA machine: one GPU each, after the trainer's.

Without this every engine process would see every GPU and take GPU 0, where
the trainer's rank 0 runs. The trainer's ranks on this node (LOCAL_WORLD_SIZE,
1 for a plain ``megarl train``) hold the first GPUs; engine ``i`` gets the
next ones. A machine with too few GPUs is refused with the numbers. A machine
with one GPU keeps sharing it (the single-GPU check runs so, with small
engines); a machine without CUDA needs nothing.
"""
from __future__ import annotations

import os

import torch

from megarl.errors import ConfigError


def engine_gpu_env(index: int, n_engines: int) -> dict[str, str] | None:
    """``{"CUDA_VISIBLE_DEVICES": ...}`` of engine ``index`` of ``n_engines``, or None (no CUDA, or one GPU)."""
    if not torch.cuda.is_available():
        return None
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        return None
    trainer_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if trainer_gpus + n_engines > n_gpus:
        raise ConfigError(f"this machine has {n_gpus} GPUs; the trainer takes {trainer_gpus} and each of "
                          f"rollout.n_engines={n_engines} engines needs one of its own ({trainer_gpus + n_engines} "
                          f"in all): set rollout.n_engines={max(n_gpus - trainer_gpus, 0)} or fewer, or run "
                          f"engines on other nodes with `megarl launch` (placement.engine_nodes)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(n_gpus)]
    return {"CUDA_VISIBLE_DEVICES": ids[trainer_gpus + index]}
