"""What a trainer checkpoint costs a layout: the bytes each node writes, the time that takes at the disk's speed
against the stop budget, and what a save holds in memory while it runs.

A save (megarl/trainer/dist_state.py) writes the weights in ``model.dtype`` and the optimizer's state: with the
distributed optimizer its fp32 main parameters and Adam's two fp32 moments, 12 B per parameter, gathered per
model shard over its DP group (experts: expert DP) into host memory of that group's rank 0, which writes it
(megatron's memory-efficient gather; :data:`SAVE_GATHER_BYTES_PER_PARAM`, measured on CPU by
tests/unit/test_save_memory.py); without it each rank holds its own full state (12 B per parameter in bf16, 8 in
fp32). What several ranks hold alike (the weights over DP, a plain optimizer's state) is written by one of them,
spread evenly (megarl/trainer/sharded_write.py). Ranks are ordered as megatron orders them: tensor parallel
fastest, then data parallel (experts: expert parallel, then expert DP), then pipeline stages.

On the GPU a save holds nothing beyond the state itself: the gather copies one parameter's state at a time to
host memory and runs over gloo. On the host the gathering ranks hold what they gathered (twice with
``logging.async_save``: the background write copies every shard to host memory again).

A stop checkpoint must be written within the stop budget: ``logging.stop_grace_s``, and Slurm's signal lead
less :data:`STOP_MARGIN_S` (launch/slurm.sbatch's ``--signal=B:USR1@240``; docs/guide.md, Preemption). The
write time is the busiest node's bytes over the disk's write speed per node (``--disk-gb-s``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from megarl.launch.memory import GB, _shards

#: host bytes per parameter of a model shard the gathering rank holds during a save: the fp32 main parameter and
#: Adam's two fp32 moments (megatron's fully_reshardable gather, whatever the model's dtype)
SAVE_GATHER_BYTES_PER_PARAM = 12.0
#: the seconds between the end of the stop budget and the end of Slurm's signal lead the stop needs beyond its
#: checkpoint (docs/guide.md: give the signal at least logging.stop_grace_s + 60 s)
STOP_MARGIN_S = 60.0
SBATCH = Path(__file__).resolve().parents[2] / "launch" / "slurm.sbatch"


def shipped_signal_lead_s() -> float | None:
    """The ``--signal=B:USR1@N`` lead of the shipped launch/slurm.sbatch, seconds (None: not found)."""
    if not SBATCH.is_file():
        return None
    m = re.search(r"--signal=B:USR1@(\d+)", SBATCH.read_text())
    return float(m.group(1)) if m else None


@dataclass
class SavePlan:
    """A checkpoint's bytes and times (module doc); ``problems`` refuse the plan, ``warnings`` do not."""

    total_bytes: float
    weight_bytes: float
    node_write_bytes: list[float]
    node_gather_bytes: list[float]
    disk_gb_s: float
    stop_budget_s: float
    budget_from: str
    save_every: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def write_s(self) -> float:
        return max(self.node_write_bytes) / (self.disk_gb_s * GB)

    def describe(self) -> str:
        busiest = max(range(len(self.node_write_bytes)), key=self.node_write_bytes.__getitem__)
        per_node = ", ".join(f"{b / GB:.1f}" for b in self.node_write_bytes)
        lines = [f"Checkpoint (a save; --disk-gb-s={self.disk_gb_s:g} per node):",
                 f"  {self.total_bytes / GB:.1f} GB per checkpoint (weights {self.weight_bytes / GB:.1f}, optimizer "
                 f"{(self.total_bytes - self.weight_bytes) / GB:.1f}); written per trainer node: {per_node} GB",
                 f"  write time {self.write_s:.0f} s (trainer node {busiest}) against the stop budget "
                 f"{self.stop_budget_s:.0f} s ({self.budget_from})",
                 f"  a save holds on the host: {max(self.node_gather_bytes) / GB:.1f} GB on the busiest trainer node "
                 f"(the optimizer gathered on its DP rank 0s); on the GPU: nothing beyond the state"]
        lines += [f"  WARNING: {w}" for w in self.warnings]
        lines += [f"  DOES NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)


def _rank_bytes(cfg, hf: dict, t) -> tuple[list[float], list[float], float]:
    """(bytes each trainer rank writes, bytes it gathers on the host, weight bytes in all)."""
    dense, experts = _shards(hf, t)
    w_b = 2 if cfg.model.dtype == "bfloat16" else 4
    dist = cfg.parallel.use_distributed_optimizer
    opt_b = SAVE_GATHER_BYTES_PER_PARAM if dist else (12 if cfg.model.dtype == "bfloat16" else 8)
    write, gather = [0.0] * t.world_size, [0.0] * t.world_size
    for r in range(t.world_size):
        dp_r = r // t.tp % t.dp
        edp_r = r // (t.tp * t.ep) % t.expert_dp
        for params, group, group_r in ((dense, t.dp, dp_r), (experts, t.expert_dp, edp_r)):
            write[r] += w_b * params / group  # replicated over the DP group: spread over it
            if dist:  # gathered on DP rank 0, which writes it
                held = opt_b * params if group_r == 0 else 0.0
                write[r] += held
                gather[r] += held
            else:
                write[r] += opt_b * params / group
    weights = w_b * (dense * t.tp * t.pp + experts * t.ep * t.tp * t.pp)
    return write, gather, weights


def save_plan(cfg, hf: dict, plan, disk_gb_s: float, signal_lead_s: float | None = None,
              host_bytes: float = 0.0) -> SavePlan:
    """The checkpoint of ``plan`` (module doc); ``signal_lead_s``: Slurm's signal lead (None: the shipped
    launch/slurm.sbatch's); ``host_bytes``: what the host plan already holds on rank 0's node
    (megarl/launch/host_memory.py), beside which a save gathers."""
    t = plan.trainer
    write, gather, weights = _rank_bytes(cfg, hf, t)
    nodes = max(len(t.hosts), 1)
    per_node = lambda v: [sum(v[n * t.ranks_per_node:(n + 1) * t.ranks_per_node]) for n in range(nodes)]  # noqa: E731
    node_write, node_gather = per_node(write), per_node(gather)
    if cfg.logging.async_save:
        node_gather = [2 * g for g in node_gather]
    grace = float(cfg.logging.stop_grace_s)
    lead = shipped_signal_lead_s() if signal_lead_s is None else signal_lead_s
    budget, said = grace, f"logging.stop_grace_s={grace:g}"
    if lead is not None and lead - STOP_MARGIN_S < grace:
        budget, said = lead - STOP_MARGIN_S, f"Slurm's signal lead {lead:g} s less {STOP_MARGIN_S:g} s"
    sp = SavePlan(sum(write), weights, node_write, node_gather, disk_gb_s, budget, said, int(cfg.logging.save_every))
    if sp.write_s > budget:
        need = int(-(-sp.write_s * 1.2 // 10) * 10)  # 20% over the estimate, rounded up to 10 s
        msg = (f"a stop checkpoint writes {max(node_write) / GB:.1f} GB from one trainer node: {sp.write_s:.0f} s "
               f"at {disk_gb_s:g} GB/s, over the stop budget of {budget:.0f} s ({said}); set "
               f"logging.stop_grace_s={need} and give Slurm --signal=B:USR1@{need + int(STOP_MARGIN_S)} "
               f"(launch/slurm.sbatch; `megarl plan --signal-lead-s` checks it), or a checkpoint disk faster per "
               f"node (--disk-gb-s is what this plan assumes)")
        sp.problems.append(msg)
    if sp.save_every and sp.write_s > budget:
        sp.warnings.append(f"each periodic save (logging.save_every={sp.save_every}) takes {sp.write_s:.0f} s too; "
                           f"a stop during one waits for it")
    if cfg.placement.host_memory_gb and node_gather[0] + host_bytes > float(cfg.placement.host_memory_gb) * GB:
        sp.problems.append(f"a save gathers {node_gather[0] / GB:.1f} GB of optimizer state on rank 0's node beside "
                           f"the {host_bytes / GB:.1f} GB the host plan holds there, over "
                           f"placement.host_memory_gb={cfg.placement.host_memory_gb:g}; set "
                           f"logging.async_save=false (one host copy) or spread the model over more GPUs "
                           f"(parallel.tp, parallel.pp, parallel.ep)")
    return sp


def as_dict(sp: SavePlan) -> dict:
    return {"checkpoint_bytes": sp.total_bytes, "weight_bytes": sp.weight_bytes,
            "node_write_bytes": sp.node_write_bytes, "node_gather_bytes": sp.node_gather_bytes,
            "write_s": sp.write_s, "stop_budget_s": sp.stop_budget_s, "disk_gb_s": sp.disk_gb_s,
            "problems": sp.problems, "warnings": sp.warnings}
