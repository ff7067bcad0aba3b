"""Save and load a MegatronTrainer's own state: one ``rank{r}.pt`` per rank (torch.save).

What a rank writes: its model chunks, the optimizer (once built; the distributed
optimizer's DP shard of exp_avg / exp_avg_sq / main params through megatron's
``get_parameter_state_dp_reshardable``), the scheduler's step count, the weight
version, the dtype, the parallel layout and the RNG states. A resume needs the
same world size, layout and dtype; each is checked with an error that names
the file. The run-level checkpoint (controller, buffer, strategy) is
megarl/checkpoint/run_checkpoint.py.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarl.errors import CheckpointError
from megarl.trainer.plain_data import load_plain


def save_trainer_state(trainer, out_dir: str) -> str:
    """This rank's model, optimizer, scheduler, version and RNG as ``out_dir/rank{r}.pt`` (torch.save).

    Every rank calls it (it is not a collective). The optimizer is saved only
    once built (it is built lazily on the first train step); the distributed
    optimizer's parameter state (its DP shard of exp_avg/exp_avg_sq/main params)
    is saved with ``get_parameter_state_dp_reshardable``, so a resume needs the
    same parallel layout (checked by :func:`load_trainer_state`).
    """
    optimizer = None
    if trainer.optimizer is not None:
        optimizer = {"state_dict": trainer.optimizer.state_dict(),
                     "param_state": [o.get_parameter_state_dp_reshardable()
                                     if hasattr(o, "get_parameter_state_dp_reshardable") else None
                                     for o in trainer._optimizers()],
                     "scheduler": trainer.scheduler.state_dict()}
    state = {"version": trainer.version, "dtype": trainer.dtype, "rank": dist.get_rank(),
             "world_size": dist.get_world_size(),
             "layout": trainer._layout(), "model": [chunk.state_dict() for chunk in trainer.model],
             "optimizer": optimizer, "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{dist.get_rank()}.pt")
    torch.save(state, path)
    return path


def load_trainer_state(trainer, in_dir: str) -> None:
    """Inverse of :func:`save_trainer_state`; CheckpointError names the file when it is missing or does not fit.

    The optimizer is built here when the checkpoint has one. The scheduler
    takes only its step count from the checkpoint: its shape (warm-up,
    decay, total steps) comes from this run's config, so a resume may
    extend or shorten a run.
    """
    path = os.path.join(in_dir, f"rank{dist.get_rank()}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing (a checkpoint of {dist.get_world_size()} trainer ranks?)")
    state = load_plain(path)
    if state["world_size"] != dist.get_world_size() or state["layout"] != trainer._layout():
        raise CheckpointError(f"{path} was written by {state['world_size']} ranks with layout {state['layout']}; "
                              f"this run has {dist.get_world_size()} ranks with {trainer._layout()}")
    saved_dtype = state.get("dtype", "float32")  # checkpoints from before bf16 training are float32
    if saved_dtype != trainer.dtype:
        # the optimizer states differ in kind (a bf16 run's holds fp32 main params), not only in precision
        raise CheckpointError(f"{path} was written by a {saved_dtype} trainer; this trainer is {trainer.dtype}")
    try:
        for chunk, sd in zip(trainer.model, state["model"], strict=True):
            chunk.load_state_dict(sd)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: model state does not fit this model ({e})") from e
    opt = state["optimizer"]
    if opt is not None:
        trainer._ensure_optimizer()
        trainer.optimizer.reload_model_params()
        trainer.optimizer.load_state_dict(opt["state_dict"])
        for o, param_state in zip(trainer._optimizers(), opt["param_state"], strict=True):
            if param_state is not None:
                # megatron-core 0.16's loader skips entries marked 'padding', a key only its sharded
                # (dist_checkpointing) writer sets; the getter's entries are all real parameters
                for gbuf_idx, by_dtype in param_state.items():
                    if isinstance(gbuf_idx, int):
                        for buckets in by_dtype.values():
                            for bucket in buckets:
                                for entry in bucket:
                                    entry.setdefault("padding", False)
                with torch.no_grad():  # copies into the optimizer's main params, which require grad
                    o.load_parameter_state_from_dp_reshardable(param_state)
        for o in trainer._optimizers():
            unshare_adam_steps(o)
        trainer.scheduler.num_steps = int(opt["scheduler"]["num_steps"])
    trainer.version = int(state["version"])
    trainer.last_skip_reason = None
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def unshare_adam_steps(optimizer) -> None:
    """Give every param its own Adam 'step' tensor after a load: megatron's optimizers hand all params one
    shared tensor, which torch's Adam increments in place once per param, breaking bias correction."""
    for st in getattr(optimizer, "optimizer", optimizer).state.values():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].clone()
