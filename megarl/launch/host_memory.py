"""The host memory plan of a trainer node: what a run keeps in a trainer node's RAM beside its processes.

`megarl plan` and `megarl launch` print it next to the GPU plan (megarl/launch/memory.py) and, when
``placement.host_memory_gb`` is set (> 0, on either device), refuse a layout whose fullest trainer node
(rank 0's) would hold more, naming the settings that would fit, the same way as a GPU that does not fit.

Every term is bytes on one trainer node, summed over its trainer ranks (``ranks_per_node`` of the plan);
a rank's parameter shard is what megarl/launch/cost.py calls ``shard_params`` (dense parameters /
(tp*pp), experts / (ep*tp*pp)):

- **recovery copies**: the recovery strategy's host copies, from the cost model
  (:func:`megarl.launch.cost.strategy_costs`, ``host_bytes_per_trainer_node``): snapshot's kept
  versions (eta + 1), ewma's average phi (none on the host with recovery.ewma.phi_on_gpu), interrupt_sync's
  kept version, each a copy of the rank's shard in the forward's dtype (phi: recovery.ewma.phi_dtype),
  plus the copy a forward under other parameters saves the current ones to (``trainer.use_params``; not
  for snapshot when it keeps the current version, trainer.publish_every=1: it restores from that copy).
  snapshot with ``recovery.snapshot.storage=disk`` keeps its versions on disk: two shard copies while it
  scores (the version read back and use_params' copy of the current parameters).
- **publish buckets** (rank 0's node only): the export of the weights, the whole model in the engines'
  dtype (rollout.dtype, else model.dtype), gathered on trainer rank 0. Every path holds it in host memory
  during a publish: ``rollout.weight_sync=broadcast`` packs it into shared-memory buckets, or under NCCL
  into device buckets of which the disk copy reads a pinned host mirror each (megarl/rollout/export_buckets.py:
  the host list always holds the whole model); ``disk`` writes an HF checkpoint from one host copy. With
  broadcast a version's buckets stay until its disk copy is written (megarl/rollout/disk_copy.py), so a disk
  slower than one step holds two exports between the next publish's prepare and its apply, and while the
  export is packed one ``rollout.bucket_mb`` bucket exists beside it (megarl/rollout/export_buckets.py
  ``pack_shared``). With ``rollout.shard_weight_sync`` and engines of several workers the send buckets
  are the export cut per worker (megarl/rollout/engine_shards.py), a copy of their own: in host shared
  memory on gloo, on the trainer's GPU under NCCL as far as its budget goes (counted whole, an upper bound).
  The broadcast publisher keeps these shared-memory buckets between publishes and packs the next
  version into them (megarl/rollout/bucket_pool.py), so the same bytes stay held from the first publish
  on rather than coming and going with each.
  Counted: broadcast two exports, the cut one and one bucket; disk one export.
- **async save copies** (``logging.async_save``): a background checkpoint copies each rank's model and
  optimizer shards to host memory and holds them until the write ends, through the steps trained
  meanwhile (megarl/trainer/sharded_write.py): the GPU plan's weights (model.dtype) and optimizer (fp32
  main parameters on bf16, Adam's two fp32 moments, over DP with the distributed optimizer) of a rank
  (:func:`megarl.launch.memory.model_state_bytes`). An upper bound: megatron writes one replica of a tensor
  that data-parallel ranks share, so the ranks that are not its main replica copy fewer weights.
- **async save strategy copies** (``logging.async_save``): the same checkpoint's host copy of the
  strategy's kept parameter state (its state_dict: snapshot's versions, read back from disk with
  storage=disk; ewma's phi, wherever it lives; interrupt_sync's kept version), held until the write ends.

Of these, **pinned** (page-locked) are the kept copies of snapshot and interrupt_sync: one flat buffer
per copy, registered with CUDA as it is, without the power-of-two rounding of torch's caching host
allocator (megarl/trainer/host_copies.py): :func:`pinned_bytes`, what the trainer allocates to within the
alignment of each tensor (under 512 B a tensor). The lockable memory of a node (``ulimit -l``) must hold it.

Not counted: the processes themselves (Python, torch, CUDA's host allocations, data and reward workers),
engines sharing the trainer nodes (``placement.engine_nodes=0``), the page cache, and the strategy
state_dict's own clone, which exists for a moment while any checkpoint is prepared.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megarl.errors import ConfigError
from megarl.launch import cost
from megarl.launch.memory import GB, model_state_bytes
from megarl.launch.placement import param_counts
from megarl.launch.recovery_bytes import ewma_phi, snapshot_storage

#: exports of the weights a broadcast publish can hold at once: the version its disk copy still writes and the next
BROADCAST_EXPORTS = 2


@dataclass
class HostMemory:
    """Host bytes of a trainer node by term (module doc), and what does not fit ``placement.host_memory_gb``."""

    strategy: str
    recovery_copies: float
    #: on rank 0's node only
    publish_buckets: float
    async_save_copies: float
    async_save_strategy_copies: float
    #: placement.host_memory_gb in bytes; 0 = not checked
    limit_bytes: float = 0.0
    #: of the terms, the page-locked bytes of a trainer node (every node alike: :func:`pinned_bytes`)
    pinned: float = 0.0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def terms(self) -> dict[str, float]:
        """The terms of rank 0's node by printed name, bytes."""
        return {f"recovery copies ({self.strategy})": self.recovery_copies, "publish buckets": self.publish_buckets,
                "async save copies": self.async_save_copies,
                "async save strategy copies": self.async_save_strategy_copies}

    @property
    def total(self) -> float:
        """Rank 0's node: every term."""
        return sum(self.terms().values())

    @property
    def other_nodes(self) -> float:
        """Any other trainer node: every term but the publish buckets."""
        return self.total - self.publish_buckets

    def parts(self) -> str:
        return ", ".join(f"{k} {v / GB:.1f}" for k, v in self.terms().items() if v or k.startswith("recovery"))

    def describe(self) -> str:
        limit = f"{self.limit_bytes / GB:g}" if self.limit_bytes else "0, not checked"
        lines = [f"Host memory per trainer node (placement.host_memory_gb={limit}; besides the processes themselves):",
                 f"  trainer node of rank 0: {self.total / GB:.1f} GB ({self.parts()})"
                 + "".join(f"; {n}" for n in self.notes)]
        if self.publish_buckets:
            lines.append(f"  other trainer nodes: {self.other_nodes / GB:.1f} GB (no publish buckets)")
        lines.append(f"  pinned (page-locked) of it, per trainer node: {self.pinned / GB:.1f} GB ("
                     + (f"the kept copies of {self.strategy}, one flat buffer each; ulimit -l must allow it)"
                        if self.pinned else f"{self.strategy} keeps no pinned copies)"))
        lines += [f"  DOES NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)


def _terms(cfg, hf: dict, plan) -> tuple[float, float, float, float, list[str]]:
    """(recovery copies, publish buckets, async save copies, async save strategy copies, notes), bytes."""
    name, t, notes = cfg.recovery.name, plan.trainer, []
    lay = cost.layout(cfg, hf, plan)
    rpn, shard = lay["ranks_per_node"], lay["shard_params"]
    # host bytes do not depend on the interpolation strategies' forward (interpolation_forward: FLOPs only)
    c = cost.strategy_costs(cfg, hf, plan, cost.Assumptions()).get(name)
    if c is None:
        notes.append(f"recovery.name={name} is not in the cost model: its host copies are not counted")
        recovery = kept = 0.0
    else:
        per_copy = shard * (ewma_phi(cfg)[0] if name == "ewma" else lay["dtype_bytes"])
        kept = c["held_copies"] * per_copy * rpn  # the strategy's state: what a checkpoint copies
        recovery = c["host_bytes_per_trainer_node"]
        if name == "snapshot" and snapshot_storage(cfg) == "disk":
            recovery = 2 * shard * lay["dtype_bytes"] * rpn
            notes.append("recovery.snapshot.storage=disk: versions on disk, two shard copies while it scores")
    export = param_counts(hf)[0] * (2 if cfg.engine_dtype == "bfloat16" else 4)
    if cfg.rollout.weight_sync == "broadcast":
        cut = lay["cut_params"] * export / param_counts(hf)[0]
        publish = BROADCAST_EXPORTS * export + cut + (max(int(cfg.rollout.bucket_mb), 1) << 20)
        notes.append(f"publish: {BROADCAST_EXPORTS} exports of {export / GB:.1f} GB ({cfg.engine_dtype}; the "
                     f"version still written to disk and the next)"
                     + (f", the send buckets cut per engine worker ({cut / GB:.1f} GB)" if cut else "")
                     + f" and one {cfg.rollout.bucket_mb} MB bucket")
    else:
        publish = export
        notes.append(f"publish: one export of {export / GB:.1f} GB ({cfg.engine_dtype})")
    async_model = async_strategy = 0.0
    if cfg.logging.async_save:
        state = model_state_bytes(cfg, hf, t)
        async_model = (state["weights"] + state["optimizer"]) * rpn
        async_strategy = kept
        notes.append(f"logging.async_save: {rpn} rank(s)' model + optimizer shards and the strategy's kept state "
                     f"held until the background write ends")
    return recovery, publish, async_model, async_strategy, notes


def host_memory(cfg, hf: dict, plan) -> HostMemory:
    """The host memory plan of ``plan``'s trainer nodes (module doc) and, when ``placement.host_memory_gb`` > 0
    and rank 0's node needs more, the one problem that says so and what would fit."""
    limit_gb = float(cfg.placement.host_memory_gb)
    if limit_gb < 0:
        raise ConfigError(f"placement.host_memory_gb must be >= 0 (0 = not checked), got {limit_gb:g}")
    *terms, notes = _terms(cfg, hf, plan)
    hm = HostMemory(cfg.recovery.name, *terms, limit_bytes=limit_gb * GB, notes=notes,
                    pinned=pinned_bytes(cfg, hf, plan))
    if limit_gb and hm.total > hm.limit_bytes:
        hm.problems.append(f"host memory of a trainer node: {hm.total / GB:.1f} GB planned on rank 0's node "
                           f"({hm.parts()}) > placement.host_memory_gb={limit_gb:g}; set "
                           + " or ".join(_fixes(cfg, hf, plan, hm.limit_bytes)))
    return hm


def pinned_bytes(cfg, hf: dict, plan) -> float:
    """Page-locked bytes of a trainer node (module doc): the copies the strategy keeps at once through
    ``trainer.keep_params`` (snapshot: its kept versions, one at a time with storage=disk, released once
    written; interrupt_sync: one), each a flat copy of a rank's shard in the forward's dtype, times the
    ranks of a node."""
    name = cfg.recovery.name
    if name not in ("snapshot", "interrupt_sync"):
        return 0.0
    lay = cost.layout(cfg, hf, plan)
    copies = 1
    if name == "snapshot" and snapshot_storage(cfg) != "disk":
        copies = cost.strategy_costs(cfg, hf, plan, cost.Assumptions())["snapshot"]["held_copies"]
    return float(copies * lay["shard_params"] * lay["dtype_bytes"] * lay["ranks_per_node"])


def planned(cfg, hf: dict, plan) -> HostMemory | None:
    """:func:`host_memory` where the commands print it: on GPUs, and on either device when
    ``placement.host_memory_gb`` is set (None otherwise: a CPU config that leaves it 0 is not planned)."""
    if plan.device == "gpu" or cfg.placement.host_memory_gb:
        return host_memory(cfg, hf, plan)
    return None


def problems(*parts) -> list[str]:
    """The problems of a GPU plan (megarl/launch/memory.py) and a host plan; None parts are skipped."""
    return [p for part in parts if part is not None for p in part.problems]


def _total(cfg, hf: dict, plan) -> float:
    return sum(_terms(cfg, hf, plan)[:4])


def _changed(cfg, changes: dict[str, Any]):
    """A copy of ``cfg`` with dotted ``changes`` (``recovery.snapshot.storage`` goes into the options)."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, *rest = key.split(".")
        if section == "recovery" and len(rest) == 2:
            opt = out.recovery.options.get(rest[0])
            if isinstance(opt, dict) or opt is None:
                out.recovery.options[rest[0]] = {**(opt or {}), rest[1]: value}
            else:
                out.recovery.options[rest[0]] = dataclasses.replace(opt, **{rest[1]: value})
        else:
            setattr(getattr(out, section), rest[0], value)
    return out


def _fixes(cfg, hf: dict, plan, limit: float) -> list[str]:
    """The single settings that would make rank 0's node fit (each checked), then the layout's own levers."""
    tries: list[dict[str, Any]] = []
    if cfg.recovery.name == "snapshot":
        if snapshot_storage(cfg) != "disk":
            tries.append({"recovery.snapshot.storage": "disk"})
        tries += [{"rollout.eta": eta} for eta in range(cfg.rollout.eta - 1, -1, -1)]
    if cfg.logging.async_save:
        tries.append({"logging.async_save": False})
    if cfg.rollout.weight_sync == "broadcast":
        tries.append({"rollout.weight_sync": "disk"})
    fixes = []
    for change in tries:
        if "rollout.eta" in change and any("rollout.eta" in f for f in fixes):
            continue  # the largest eta that fits only
        total = _total(_changed(cfg, change), hf, plan)
        if total <= limit:
            said = " with ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())
            fixes.append(f"{said} ({total / GB:.1f} GB)")
    fit: dict[str, list[str]] = {}
    for name in cost.STRATEGIES:
        if name != cfg.recovery.name:
            total = _total(_changed(cfg, {"recovery.name": name}), hf, plan)
            if total <= limit:
                fit.setdefault(f"{total / GB:.1f}", []).append(name)
    fixes += [f"recovery.name={'|'.join(names)} ({gb} GB)" for gb, names in sorted(fit.items(),
                                                                                   key=lambda kv: -float(kv[0]))]
    fixes += ["fewer trainer ranks per node (placement.trainer_ranks over more placement.trainer_nodes) or larger "
              "model-parallel sizes (parallel.tp, parallel.pp, parallel.ep: smaller shards per rank)",
              "placement.host_memory_gb to what the nodes have, if it is more"]
    return fixes


def as_dict(hm: HostMemory) -> dict[str, Any]:
    return {"host_memory_gb": hm.limit_bytes / GB, "rank0_node_bytes": hm.total, "other_node_bytes": hm.other_nodes,
            "pinned_bytes": hm.pinned, "terms": hm.terms(), "notes": hm.notes, "problems": hm.problems}
