"""Recovery-strategy state with the model's parameter shapes, saved sharded like the model.

A strategy's copies of the weights (ewma's anchor ``phi``, snapshot's held versions, interrupt_sync's
kept version) are dicts ``{megatron parameter name: this rank's shard}`` (``MegatronTrainer.get_params``).
Saved as they are, they resume only in the layout that wrote them. Here every such dict found in a
strategy's ``state_dict`` is written through megatron-core ``dist_checkpointing`` (torch_dist) under the
sharding of the parameter it copies: each tensor becomes the model's own ``ShardedTensor`` (or factory)
for that parameter with the copy as its data and ``strategy/<path>/<global key>`` as its key. A resume
in another TP / PP / EP / DP layout then reads every copy re-cut for its own shards, exactly like the
model's weights (megarl/trainer/dist_state.py).

The rest of the state (counters, versions, the dedicated scorer's files) stays a plain pickle, one per
rank, with a placeholder where each parameter dict was. A resume with the same world size reads its
own rank's; with another world size every rank reads rank 0's (a strategy's non-tensor state is the
same on every rank, except the dedicated scorer's, which only rank 0 uses).

What counts as a parameter dict: a dict whose keys are exactly the names of this rank's parameters and
whose values are tensors of those parameters' shapes (in any dtype: a bf16 run's copies stay bf16).
Both the save and the load are collectives of every trainer rank.
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.errors import CheckpointError
from megarl.trainer.plain_data import load_plain
from megarl.trainer.sharded_write import quiet_upstream, save_sharded

#: marks where a parameter dict was in the pickled rest of a strategy's state
PLACEHOLDER = "__megarl_param_dict__"
#: the dist_checkpointing directory of the parameter dicts, inside a checkpoint's strategy/ directory
SHARDED_DIR = "sharded"


def _param_shardings(trainer) -> dict:
    """This rank's ``{parameter name: ShardedTensor or factory}`` of model chunk 0 (the names get_params uses)."""
    from megarl.trainer.dist_state import _modules

    module = _modules(trainer)[0]
    names = {n for n, _ in module.named_parameters()}
    return {k: v for k, v in module.sharded_state_dict().items() if k in names}


def _shape(sharding) -> torch.Size:
    """This rank's shape of a parameter: a ShardedTensor's local shape, a factory's tensor's."""
    return torch.Size(sharding.local_shape) if hasattr(sharding, "local_shape") else sharding.data.shape


def _is_param_dict(value: Any, shapes: dict[str, torch.Size]) -> bool:
    return (isinstance(value, dict) and bool(value) and set(value) == set(shapes)
            and all(torch.is_tensor(t) and t.shape == shapes[k] for k, t in value.items()))


def split_state(state: Any, shapes: dict[str, torch.Size], path: str = "") -> tuple[Any, dict[str, dict]]:
    """``(rest, {path: parameter dict})``: ``state`` with each parameter dict replaced by a placeholder."""
    if _is_param_dict(state, shapes):
        dtypes = {k: str(t.dtype).removeprefix("torch.") for k, t in state.items()}
        return {PLACEHOLDER: path, "dtypes": dtypes}, {path: state}
    if isinstance(state, dict):
        rest, found = {}, {}
        for k, v in state.items():
            rest[k], sub = split_state(v, shapes, f"{path}/{k}" if path else str(k))
            found.update(sub)
        return rest, found
    return state, {}


def _placeholders(rest: Any) -> dict[str, dict]:
    if isinstance(rest, dict) and PLACEHOLDER in rest:
        return {rest[PLACEHOLDER]: rest["dtypes"]}
    if isinstance(rest, dict):
        out = {}
        for v in rest.values():
            out.update(_placeholders(v))
        return out
    return {}


def _fill(rest: Any, loaded: dict[str, dict]) -> Any:
    if isinstance(rest, dict) and PLACEHOLDER in rest:
        return loaded[rest[PLACEHOLDER]]
    if isinstance(rest, dict):
        return {k: _fill(v, loaded) for k, v in rest.items()}
    return rest


def _sharded(shardings: dict, path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """The parameter dict as ShardedTensors (factories) of the parameters it copies, keyed strategy/<path>/."""
    out = {}
    for name, t in tensors.items():
        sh = shardings[name]
        fields = {"key": f"strategy/{path}/{sh.key}", "data": t}
        if "dtype" in {f.name for f in dataclasses.fields(sh)}:
            fields["dtype"] = t.dtype
        out[name] = dataclasses.replace(sh, **fields)
    return out


def _rank_file(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.pt")


def prepare_strategy_state(trainer, state: dict, out_dir: str, *, background: bool = False) -> Callable[[Any], None]:
    """Prepare the save of ``state`` (a strategy's state_dict on this rank) to ``out_dir`` (module doc) and return
    its write, ``write(group)``: like megarl/trainer/dist_state.py's ``prepare_reshardable``, a collective now
    and a collective of ``group`` when written."""
    shardings = _param_shardings(trainer)
    rest, found = split_state(state, {k: _shape(v) for k, v in shardings.items()})
    os.makedirs(out_dir, exist_ok=True)
    paths: list = [None] * dist.get_world_size()
    dist.all_gather_object(paths, sorted(found))
    if any(p != paths[0] for p in paths):
        raise CheckpointError(f"the strategy's parameter copies differ across trainer ranks ({paths}): "
                              "every rank must hold copies of the same versions")
    shards = None
    if found:
        sharded = {p: _sharded(shardings, p, t) for p, t in found.items()}
        os.makedirs(os.path.join(out_dir, SHARDED_DIR), exist_ok=True)  # megatron's save wants it there and empty
        shards = save_sharded(sharded, os.path.join(out_dir, SHARDED_DIR), background=background)
    rank, world = dist.get_rank(), dist.get_world_size()
    pickled = io.BytesIO()  # serialised now: the strategy may change what ``rest`` refers to while it is written
    torch.save({"rest": rest, "world_size": world}, pickled)

    def write(group) -> None:
        if shards is not None:
            shards.run(group)
        with open(_rank_file(out_dir, rank), "wb") as f:
            f.write(pickled.getvalue())
        dist.barrier(group=group)

    return write


def save_strategy_state(trainer, state: dict, out_dir: str) -> None:
    """Write ``state`` to ``out_dir`` now (:func:`prepare_strategy_state` and its write); a collective."""
    prepare_strategy_state(trainer, state, out_dir)(None)


def _read(path: str) -> dict:
    return load_plain(path)


def load_strategy_state(trainer, in_dir: str) -> dict:
    """This rank's strategy state_dict from ``in_dir``, re-cut for this rank's shards; a collective.

    A directory of the per-rank format (``rank{r}.pt`` holding the whole state, before this module)
    loads only with the same world size.
    """
    from megatron.core import dist_checkpointing

    mine = _read(_rank_file(in_dir, dist.get_rank())) if os.path.isfile(_rank_file(in_dir, dist.get_rank())) \
        else None
    saved = mine if mine is not None else _read(_rank_file(in_dir, 0))
    if not (isinstance(saved, dict) and "rest" in saved and "world_size" in saved):  # the per-rank format
        if mine is None:
            raise CheckpointError(f"{_rank_file(in_dir, dist.get_rank())} is missing: {in_dir} is a per-rank "
                                  "strategy state, which resumes only with the trainer ranks that wrote it")
        return mine
    if saved["world_size"] != dist.get_world_size():
        saved = _read(_rank_file(in_dir, 0))
    rest = saved["rest"]
    wanted = _placeholders(rest)
    if not wanted:
        return rest
    shardings = _param_shardings(trainer)
    want = {}
    for p, dtypes in wanted.items():
        # the names are this rank's (another PP stage's local names differ); the dtypes the saver's
        fallback = next(iter(dtypes.values()))
        empty = {name: torch.empty(_shape(sh), dtype=getattr(torch, dtypes.get(name, fallback)))
                 for name, sh in shardings.items()}
        want[p] = _sharded(shardings, p, empty)
    try:
        with quiet_upstream():
            loaded = dist_checkpointing.load(want, os.path.join(in_dir, SHARDED_DIR))
    except Exception as e:  # missing keys, shape mismatches, damaged files
        raise CheckpointError(f"{in_dir}: the strategy's parameter copies cannot be loaded into this layout "
                              f"({type(e).__name__}: {e})") from e
    return _fill(rest, {p: {n: t.detach().clone() for n, t in d.items()} for p, d in loaded.items()})
