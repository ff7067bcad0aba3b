"""GPUs of the engines `megarl train` starts itself on a CUDA machine: ``placement.engine_tp`` each (one per
vLLM tensor-parallel worker), after the trainer's.

Without this every engine process would see every GPU and take GPU 0, where
the trainer's rank 0 runs. The trainer's ranks on this node (LOCAL_WORLD_SIZE,
1 for a plain ``megarl train``) hold the first GPUs; engine ``i`` gets the
next ones. A machine with too few GPUs is refused with the numbers. A machine
with one GPU keeps sharing it (the single-GPU check runs so, with small
engines of one worker); a machine without CUDA needs nothing.
"""
from __future__ import annotations

import os

import torch

from megarl.errors import ConfigError


def engine_gpu_env(index: int, n_engines: int, tp: int = 1) -> dict[str, str] | None:
    """``{"CUDA_VISIBLE_DEVICES": ...}`` of engine ``index`` of ``n_engines`` of ``tp`` workers each, or None (no
    CUDA, or one GPU shared by a one-worker engine)."""
    if not torch.cuda.is_available():
        return None
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2 and tp == 1:
        return None
    trainer_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if trainer_gpus + n_engines * tp > n_gpus:
        raise ConfigError(f"this machine has {n_gpus} GPUs; the trainer takes {trainer_gpus} and each of "
                          f"rollout.n_engines={n_engines} engines needs placement.engine_tp={tp} of its own "
                          f"({trainer_gpus + n_engines * tp} in all): set rollout.n_engines="
                          f"{max((n_gpus - trainer_gpus) // tp, 0)} or fewer, or run engines on other nodes with "
                          f"`megarl launch` (placement.engine_nodes)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(n_gpus)]
    first = trainer_gpus + index * tp
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[first:first + tp])}
