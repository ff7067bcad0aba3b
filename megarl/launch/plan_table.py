"""Describe a :class:`~megarl.launch.placement.Plan` for people: the table ``megarl plan`` and ``megarl launch`` print.

Which role runs on which node with which slots and layout, the rendezvous address, how weights reach the
engines and the nodes used. The commands themselves come from :mod:`megarl.launch.role_commands`.
"""
from __future__ import annotations

from megarl.launch.cluster import compress_hosts


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else str(n)


def _gpu_ranges(ids) -> str:
    ids = list(ids)
    if not ids:
        return "-"
    return f"gpu {ids[0]}" if len(ids) == 1 else f"gpus {ids[0]}-{ids[-1]}"


def describe_plan(plan) -> str:
    m, t = plan.model, plan.trainer
    moe = f", {m['experts']} experts top-{m['topk']}" if "experts" in m else ""
    lines = [
        f"model       {m['architecture']}: {m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV heads{moe}, "
        f"vocab {m['vocab']}; {_billions(m['params'])} params ({_billions(m['active_params'])} active)",
        f"allocation  {plan.allocation.describe()}",
        f"device      {plan.device}; recovery {plan.recovery}; engines {plan.backend}; weight sync {plan.weight_sync}",
        "",
        f"{'role':<11} {'node':<14} {'slots':<18} layout",
    ]
    unit = "GPUs" if plan.device == "gpu" else "ranks"
    sp = ", sequence parallel" if t.sequence_parallel else ""
    layout = (f"tp={t.tp} pp={t.pp} ep={t.ep} dp={t.dp} (expert dp={t.expert_dp}){sp}; "
              f"{t.world_size} ranks, rank 0 = controller")
    for i, h in enumerate(t.hosts):
        slots = f"{t.ranks_per_node} {unit}" + (f" ({_gpu_ranges(t.gpu_ids)})" if t.gpu_ids else "")
        lines.append(f"{'trainer':<11} {h:<14} {slots:<18} {layout if i == 0 else '(same world)'}")
    for s in plan.servers:
        at = f" on {s.address}" if s.address else ""
        where = "spawned by the controller" if s.spawned else f"port {s.port}{at}"
        what = "vLLM TP" if s.role == "engine" and plan.backend == "vllm" else "TP"
        slots = _gpu_ranges(s.gpu_ids) if s.gpu_ids else "1 process"
        lines.append(f"{s.name:<11} {s.host:<14} {slots:<18} {what}={s.tp}; {where}")
    if plan.dedicated is None:
        lines.append(f"{'dedicated':<11} {'-':<14} {'-':<18} none (recovery.name={plan.recovery})")
    lines.append("")
    one_node = "" if plan.master_port_explicit or len(t.hosts) > 1 else \
        " (one trainer node: torchrun --standalone and mpirun pick a free local port instead)"
    lines.append(f"rendezvous  MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port}{one_node}")
    if plan.weight_sync == "broadcast" and all(s.spawned for s in plan.servers):
        lines.append("weights     gloo broadcast group set up by the controller with the engines it spawns")
    elif plan.weight_sync == "broadcast":
        backend = "NCCL" if plan.device == "gpu" else "gloo"
        lines.append(f"weights     {backend} broadcast from trainer rank 0 at "
                     f"{plan.master_addr}:{plan.weight_sync_port} "
                     f"to {plan.weight_sync_world - 1} engine worker(s) (group of {plan.weight_sync_world})")
    else:
        lines.append("weights     safetensors under <run_dir>/weights, loaded by every engine")
    used = plan.hosts_used
    lines.append(f"nodes used  {len(used)}: {compress_hosts(used)}")
    for note in plan.notes:
        lines.append(f"note        {note}")
    return "\n".join(lines)
