"""The README's strategy-cost table, generated from the cost model (megarl/launch/cost.py) of the GPU configs.

One row per strategy and one column per shipped GPU config, each cell what `megarl plan --config CFG --cost`
predicts with its default assumptions: the seconds a strategy adds to a step on the critical path (its
trainer forwards, the part of its host<->GPU copies on the critical path (swaps, ewma's with its fold: all; the
kept copy of a published version: what the next update does not hide), and for dedicated the part
of the scorer's time the trainer's update does not hide) as a share of the baseline step (the update
itself: forward and backward over the batch, 3 forwards' FLOPs), the host memory per trainer node, the
PCIe bytes per GPU, the stall per publish, and, in the header, the disk copy every publish writes in the
background (weights / disk bandwidth; an engine restart loads it). Regenerate the table with
``python -m megarl.launch.cost_table`` and paste it between the markers; tests/unit/test_cost_table.py
fails when the README and the model disagree.
"""
from __future__ import annotations

import sys
from pathlib import Path

from megarl.launch import cost

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("configs/qwen3_4b_h100.yaml", "configs/qwen3_30b_a3b_h100.yaml")
BEGIN, END = "<!-- cost-table:begin (python -m megarl.launch.cost_table) -->", "<!-- cost-table:end -->"


def config_costs(config: str) -> tuple[dict, dict, float, float, int]:
    """(costs per strategy, layout, baseline step s, disk copy s per publish, nodes used) of ``config``
    with the cost model's default assumptions, on the allocation its placement asks for."""
    from megarl.builder import load_run_config  # the strategies' config classes (torch)
    from megarl.launch import cluster
    from megarl.launch.placement import load_hf_config, resolve_plan
    from megarl.losses.policy import normalizer_needs_anchor

    cfg = load_run_config(ROOT / config)
    hf, _ = load_hf_config(cfg)
    p = cfg.placement
    plan = resolve_plan(cfg, hf, cluster.simulated(p.trainer_nodes + p.engine_nodes, p.gpus_per_node))
    a = cost.Assumptions()
    costs = cost.strategy_costs(cfg, hf, plan, a, interpolation_forward=normalizer_needs_anchor(cfg.loss))
    lay = cost.layout(cfg, hf, plan)
    rate = lay["trainer_gpus"] * a.peak_tflops * 1e12 * a.mfu
    baseline = 3 * 2.0 * lay["active_params"] * cost.step_tokens(cfg, a) / rate
    disk = lay["params"] * lay["dtype_bytes"] / (a.disk_gb_s * 1e9)
    return costs, lay, baseline, disk, len(plan.hosts_used)


def critical_s(c: dict) -> float:
    """Seconds a strategy adds to a step on the critical path (module doc)."""
    return c["trainer_forward_s_per_step"] + c["pcie_critical_s_per_step"] + c["dedicated_critical_s_per_step"]


def cell(c: dict, baseline: float) -> str:
    extra = critical_s(c)
    parts = [f"+{extra:.2f} s / step ({extra / baseline:.0%})" if extra > 0 else "+0 s / step"]
    if c["pcie_bytes_per_gpu_per_step"]:
        parts.append(f"PCIe {c['pcie_bytes_per_gpu_per_step'] / 1e9:.0f} GB / GPU ({c['pcie_s_per_step']:.1f} s, "
                     f"{c['pcie_critical_s_per_step']:.1f} on the critical path)")
    if c["host_bytes_per_trainer_node"]:
        parts.append(f"host {c['host_bytes_per_trainer_node'] / 1e9:.0f} GB / node")
    if c["dedicated_gpus"]:
        parts.append(f"+{c['dedicated_gpus']} GPU, peak {c['dedicated_gpu_bytes'] / 1e9:.0f} GB")
    parts.append(f"stall {c['stall_s_per_publish']:.1f} s / publish")
    return "; ".join(parts)


def render() -> str:
    cols = [(config, *config_costs(config)) for config in CONFIGS]
    head = " | ".join(f"`{config}`, {lay['trainer_gpus']} trainer + {lay['engine_workers']} engine H100 on "
                      f"{nodes} nodes: baseline step {base:.1f} s, "
                      f"network {costs['behav']['network_bytes_per_publish'] / 1e9:.0f} GB / publish, "
                      f"disk copy {disk:.0f} s / publish (background)"
                      for config, costs, lay, base, disk, nodes in cols)
    lines = [f"| strategy | {head} |", "|---|" + "---|" * len(cols)]
    for name in cost.STRATEGIES:
        lines.append(f"| {name} | " + " | ".join(cell(costs[name], base) for _, costs, _, base, _, _ in cols) + " |")
    return "\n".join(lines)


def readme_table(readme: Path = ROOT / "README.md") -> str:
    """The table between the README's markers."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    sys.stdout.write(render() + "\n")
