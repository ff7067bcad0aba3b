"""A MegatronTrainer's state in a layout-free form: it resumes into another TP / DP layout.

What a save writes to ``out_dir`` (every rank calls :func:`save_reshardable`; it is a collective):

- the model and the optimizer through megatron-core ``dist_checkpointing`` in its ``torch_dist``
  format (``.metadata``, ``__{rank}_{i}.distcp``, ``common.pt``, ``metadata.json``). Each tensor is
  stored under its global name and shape (megatron's ``ShardedTensor``: this rank's slice and its
  offset in the full tensor), so Adam's ``exp_avg`` / ``exp_avg_sq`` and the main parameters are
  keyed by the model parameter they belong to, not by a rank's flat buffer. The distributed
  optimizer's state goes in the ``fully_reshardable`` sharding type (passed explicitly): at save
  its DP shards are gathered over DP into per-parameter tensors, sliced like the parameter
  (megatron's default, ``fully_sharded_model_space``, fails in megatron-core 0.16.1 with
  "ShardedTensor.flattened_range is not supported"). The gather is megatron's memory-efficient
  one (``distrib_optim_fully_reshardable_mem_efficient``): over the DP group's gloo group, bucket
  by bucket, into host memory of DP rank 0 alone, which writes the optimizer state. Without it
  megatron all-gathers the whole optimizer state to every DP rank (over NCCL, through the GPU): 12 B
  per parameter of the model shard on each rank during a save, against 12 / dp at rest
  (tests/unit/test_save_memory.py measures both). The plan counts the gathered state on DP rank 0's
  host (megarl/launch/save_plan.py).
- ``megarl_trainer.pt`` (rank 0, torch.save, written last: a directory without it is incomplete):
  the weight version, the dtype, whether the optimizer is the distributed one, the scheduler's
  step count, the layout that wrote it (for messages only) and every rank's torch RNG state.

How a reshard works: the loading trainer builds the sharded state dict of *its own* model and
optimizer (the same global names, its own slices) and ``dist_checkpointing.load`` reads, for each
slice, the overlapping pieces of the saved slices; then the model and the optimizer load them as
their ordinary state dicts. A TP2 checkpoint read at TP1 gives each full weight from the two
halves; the distributed optimizer cuts its new DP shards out of the per-parameter state.
Measured on CPU/gloo: TP2 -> TP1, TP2 -> PP2 and DP2 -> DP1 (distributed optimizer) of the dense model,
EP2 -> EP1 of the tiny MoE (tests/distributed/test_reshard.py). A bf16 run goes through the same code;
its same-layout resume is tested (tests/distributed/test_checkpoint_multirank.py), a bf16 reshard is not.
What must match: the dtype (a bf16 run's optimizer holds fp32 main parameters, an fp32 run's
does not) and the kind of optimizer (distributed or not: a load across kinds is refused, as it is
untested); the model's shape is the run checkpoint's check (megarl/checkpoint/settings.py). The RNG state is
restored
per rank when the world size is the same, else every rank takes rank 0's.

The save is written in this process (megarl/trainer/sharded_write.py: megatron's own writer starts
processes that hang under torchrun), now or, prepared at the call, on a writer thread while the
trainer goes on (:func:`prepare_reshardable`).

A directory of the per-rank format (``rank{r}.pt``, megarl/trainer/state.py) is loaded through
that format's loader, which requires the same layout.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.errors import CheckpointError
from megarl.trainer.plain_data import load_plain
from megarl.trainer.sharded_write import quiet_upstream, save_sharded
from megarl.trainer.state import load_trainer_state, unshare_adam_steps

#: the layout-free items (rank 0 writes it last; its presence marks a complete checkpoint)
STATE_FILE = "megarl_trainer.pt"
FORMAT = "megarl.reshardable.v1"
#: the distributed optimizer's state as per-parameter tensors (module doc)
DIST_OPT_SHARDING = "fully_reshardable"


def _optimizer_metadata() -> dict:
    # chained_optim_avoid_prefix: tensor keys name the parameter only, not the index of the
    # chained optimizer holding it (which depends on how parameters were grouped)
    return {"distrib_optim_sharding_type": DIST_OPT_SHARDING, "chained_optim_avoid_prefix": True,
            "distrib_optim_fully_reshardable_mem_efficient": True}


def _modules(trainer) -> list:
    """The GPTModel of each chunk, without the DDP / Float16Module wrappers (their names carry no
    ``module.`` prefix then, whatever the dtype)."""
    out = []
    for chunk in trainer.model:
        while hasattr(chunk, "module"):
            chunk = chunk.module
        out.append(chunk)
    return out


def _model_sharded(trainer) -> dict:
    # nested by chunk; a tensor's identity in the checkpoint is its ShardedTensor key (global layer
    # numbers), not where it sits in this dict
    return {f"chunk{i}": m.sharded_state_dict() for i, m in enumerate(_modules(trainer))}


def _sharded_state(trainer, is_loading: bool) -> dict:
    model = _model_sharded(trainer)
    state = {"model": model}
    if trainer.optimizer is not None:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                                  metadata=_optimizer_metadata())
    return state


def prepare_reshardable(trainer, out_dir: str, *, background: bool = False) -> Callable[[Any], None]:
    """Prepare the save of the trainer's state to ``out_dir`` (module doc) and return its write, ``write(group)``.

    The preparation is a collective of every trainer rank on the default group (the tensors' layout,
    ``common.pt``, the version, scheduler step and every rank's RNG state as of now); with ``background=True``
    it also copies this rank's shards to host memory, and the write may run on another thread over
    megarl/trainer/sharded_write.py's ``checkpoint_group()`` while the trainer goes on. The write is a
    collective of that group: the shards, then ``megarl_trainer.pt`` (rank 0, last: the mark of a complete
    directory).
    """
    os.makedirs(out_dir, exist_ok=True)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(out_dir, STATE_FILE)):
        os.remove(os.path.join(out_dir, STATE_FILE))  # a rewrite is incomplete until it is back
    dist.barrier()
    shards = save_sharded(_sharded_state(trainer, is_loading=False), out_dir, background=background)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, torch.get_rng_state())
    small = {"format": FORMAT, "version": trainer.version, "dtype": trainer.dtype,
             "distributed_optimizer": bool(trainer._opt_args["use_distributed_optimizer"]),
             "has_optimizer": trainer.optimizer is not None,
             "scheduler_num_steps": None if trainer.scheduler is None else int(trainer.scheduler.num_steps),
             "layout": trainer._layout(), "world_size": dist.get_world_size(), "torch_rng": rngs}

    def write(group) -> None:
        shards.run(group)
        if dist.get_rank(group) == 0:
            tmp = os.path.join(out_dir, STATE_FILE + ".tmp")
            torch.save(small, tmp)
            os.replace(tmp, os.path.join(out_dir, STATE_FILE))
        dist.barrier(group=group)

    return write


def save_reshardable(trainer, out_dir: str) -> dict:
    """Write the trainer's state to ``out_dir`` now (:func:`prepare_reshardable` and its write); a collective of
    every trainer rank. Returns ``{"seconds": ...}``, the time the save took on this rank."""
    t0 = time.perf_counter()
    prepare_reshardable(trainer, out_dir)(None)
    return {"seconds": time.perf_counter() - t0}


def is_per_rank_checkpoint(in_dir: str) -> bool:
    """A directory of megarl/trainer/state.py's per-rank format (``rank{r}.pt``, no sharded files)."""
    return (not os.path.exists(os.path.join(in_dir, STATE_FILE))
            and not os.path.exists(os.path.join(in_dir, "metadata.json"))
            and os.path.isfile(os.path.join(in_dir, "rank0.pt")))


def _read_small(in_dir: str) -> dict:
    path = os.path.join(in_dir, STATE_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {in_dir} is not a complete reshardable trainer checkpoint "
                              f"(its save did not finish?)")
    small = load_plain(path)
    if not isinstance(small, dict) or small.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    return small


def _allocate_adam_state(trainer) -> None:
    """Zero Adam moments and step for a distributed optimizer that has not stepped yet.

    Its sharded state dict reads the step count off the inner optimizer's state, which torch's Adam
    creates only on its first step; the load then overwrites these tensors.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for o in trainer._optimizers():
        if not isinstance(o, DistributedOptimizer):  # megatron's other optimizers allocate their own
            continue
        inner = o.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def _inner(part: dict) -> dict:
    """The torch-optimizer part of one megatron optimizer's state (a mixed-precision one nests it)."""
    return part["optimizer"] if isinstance(part.get("optimizer"), dict) else part


def _fit_chain(trainer, loaded: dict) -> dict:
    """The loaded optimizer state in this trainer's chain of optimizers.

    An MoE model's optimizer is a chain of two (dense and expert parameters) at EP > 1 and one optimizer at
    EP 1. The per-parameter tensors come back in this trainer's structure (keyed by parameter), but the
    checkpoint's non-tensor part (the param groups' settings, the shared Adam step) comes in the saver's:
    here that part is rebuilt for this trainer's optimizers, the settings from this run's own param groups
    and the step from the checkpoint (one step count for all: every optimizer of a chain steps together).
    """
    opts = trainer._optimizers()
    saved_ids = sorted(k for k in loaded if isinstance(k, int))
    cur_ids = list(range(len(opts))) if len(opts) > 1 else []
    if saved_ids == cur_ids:
        return loaded
    if trainer._opt_args["use_distributed_optimizer"]:
        raise CheckpointError(f"the checkpoint's optimizer is a chain of {len(saved_ids) or 1} and this trainer's "
                              f"of {len(opts)} (expert parallelism changed?): with the distributed optimizer that "
                              "change is not supported; resume with the run's parallel.ep")
    saved = [loaded[k] for k in saved_ids] or [loaded]
    steps = {float(_inner(p)["state"]["common_step"]) for p in saved if "common_step" in _inner(p).get("state", {})}
    if len(steps) > 1:
        raise CheckpointError(f"the checkpoint's optimizers have taken different step counts {sorted(steps)}")
    parts = [loaded[k] for k in cur_ids] or [{k: v for k, v in loaded.items() if not isinstance(k, int)}]
    for o, part in zip(opts, parts, strict=True):
        sd = _inner(part)
        for group, mine in zip(sd["param_groups"], o.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in mine.items() if k != "params"})
        if steps:
            sd["state"]["common_step"] = torch.tensor(next(iter(steps)))
    return parts[0] if not cur_ids else dict(enumerate(parts))


def _load_optimizer(trainer, state) -> None:
    state = _fit_chain(trainer, state)
    opts = trainer._optimizers()
    per_optimizer = [state] if len(opts) == 1 else [state[i] for i in range(len(opts))]
    for o, sd in zip(opts, per_optimizer, strict=True):
        param_state = sd.pop("param_state", None)
        with torch.no_grad():  # copies into the optimizer's main params, which require grad
            o.load_state_dict(sd)  # of a distributed optimizer: all but the parameter state
            inner = getattr(o, "optimizer", o)
            if param_state is not None:
                kind = sd.pop("param_state_sharding_type", None)
                if kind != DIST_OPT_SHARDING:
                    raise CheckpointError(f"the optimizer state is in the {kind!r} sharding type; megarl writes and "
                                          f"reads {DIST_OPT_SHARDING!r} (a checkpoint of another writer?)")
                # megatron-core 0.16.1's fully_reshardable loader copies every key of the inner state,
                # torch Adam's per-param 'step' too, from the checkpoint, which has none (step lives in
                # the param groups): set it aside for the copy
                steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
                o.load_parameter_state_from_fully_reshardable(param_state)
                for p, step in steps.items():
                    inner.state[p]["step"] = step
        unshare_adam_steps(o)


def load_reshardable(trainer, in_dir: str) -> dict:
    """Inverse of :func:`save_reshardable`, into this trainer's layout; a collective of every trainer rank.

    A per-rank checkpoint (megarl/trainer/state.py) goes through that format's loader (same layout
    only). CheckpointError when the directory is incomplete or its state does not fit this trainer.
    The scheduler takes only its step count: its shape comes from this run's config.
    Returns ``{"seconds": ..., "format": ...}``.
    """
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    if is_per_rank_checkpoint(in_dir):
        try:
            load_trainer_state(trainer, in_dir)
        except CheckpointError as e:
            raise CheckpointError(f"{e}. {in_dir} is in the per-rank format (rank{{r}}.pt), which resumes only in the "
                                  f"layout that wrote it: resume with that layout, or load it there and write it "
                                  f"again with save_reshardable to change the layout") from e
        return {"seconds": time.perf_counter() - t0, "format": "per_rank"}
    small = _read_small(in_dir)
    if small["dtype"] != trainer.dtype:
        raise CheckpointError(f"{in_dir} was written by a {small['dtype']} trainer; this trainer is {trainer.dtype}")
    mine = bool(trainer._opt_args["use_distributed_optimizer"])
    if small["has_optimizer"] and small["distributed_optimizer"] != mine:
        kind = "the distributed" if small["distributed_optimizer"] else "a non-distributed"
        raise CheckpointError(f"{in_dir} holds the state of {kind} optimizer (layout {small['layout']}); this "
                              f"trainer has use_distributed_optimizer={mine}: resume with the same kind")
    if small["has_optimizer"]:
        trainer._ensure_optimizer()
        _allocate_adam_state(trainer)
    want = _sharded_state(trainer, is_loading=True)
    if not small["has_optimizer"]:
        want.pop("optimizer", None)
    try:
        with quiet_upstream():
            loaded = dist_checkpointing.load(want, in_dir)
    except Exception as e:  # missing keys, shape mismatches, damaged files: megatron's and torch's own errors
        raise CheckpointError(f"{in_dir} (written with layout {small['layout']}) cannot be loaded into layout "
                              f"{trainer._layout()}: {type(e).__name__}: {e}") from e
    try:
        for i, module in enumerate(_modules(trainer)):
            module.load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{in_dir}: model state does not fit this model ({e})") from e
    if small["has_optimizer"]:
        _load_optimizer(trainer, loaded["optimizer"])
        trainer.scheduler.num_steps = int(small["scheduler_num_steps"])
    trainer.version = int(small["version"])
    trainer.last_skip_reason = None
    rngs = small["torch_rng"]
    torch.set_rng_state(rngs[dist.get_rank()] if len(rngs) == dist.get_world_size() else rngs[0])
    return {"seconds": time.perf_counter() - t0, "format": FORMAT}
