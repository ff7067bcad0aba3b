"""What each strategy costs on this setup: measured step time (`megarl bench`'s runs) and planned memory.

Time. Each strategy trains a few steps through `megarl bench`'s own machinery
(:func:`megarl.bench.run.run_strategy`: a fresh process per strategy on the
shared engines, without the verifier), and :func:`megarl.bench.report.summarize`
and :func:`~megarl.bench.report.publish_stall` read its metrics: the median
step over steps 2..N, the strategy's own anchor time and the median publish
stall. A strategy's added step time (``added_step_s``) is the median over
steps 2..N of the seconds of its own work the trainer loop waits for (bench's
``critical``: its anchor, dedicated's waits for its scorer included, its
publish-time scoring and its hooks); ``step_minus_behav_s`` is its median step
minus behav's, which also holds the noise of the batch waits. Runs
go in :data:`ORDER` (behav first: it is the baseline) while the time budget
lasts; a strategy whose run would not fit in what is left (estimated from the
longest run so far) is skipped and listed as such.

Memory. The cost model of `megarl plan --cost` (megarl/launch/cost.py) on the
config's placement gives each strategy's extra host bytes per trainer node,
GPU bytes per trainer GPU and the dedicated scorer's GPU; on GPU plans the
trainer GPU's own peak comes from megarl/launch/memory.py. A strategy fits
when its host bytes fit ``host_memory_gb`` (default: this machine's memory)
and, on GPUs, its trainer GPU and scorer GPU fit ``placement.gpu_memory_gb``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

#: the order in which strategies are timed: the baseline, then the cheapest anchors, then the exact ones
ORDER = ("behav", "loglinear", "recompute", "ewma", "linear", "snapshot", "interrupt_sync", "dedicated")
GB = 1e9


def machine_memory_gb() -> float:
    """This machine's physical memory, GB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def step_minus_behav_s(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per measured strategy: median step time minus behav's (None without a behav run)."""
    base = runs.get("behav", {}).get("step_time_s_median")
    return {name: (r["step_time_s_median"] - base if base is not None else None) for name, r in runs.items()}


def critical_s_median(records: list[dict[str, Any]]) -> float:
    """Median over steps 2..N of the strategy's critical-path seconds (megarl/bench/report.py's ``critical``)."""
    import statistics

    from megarl.bench import report

    phases = report.step_phases(records)
    steady = phases[1:] or phases
    return statistics.median(p["critical"] for p in steady)


def time_strategies(config: str, overrides: list[str], strategies: list[str], steps: int, out: Path, pool: Any,
                    deadline: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run each of ``strategies`` for ``steps`` steps while ``deadline`` (time.monotonic) allows; returns
    ``{"steps", "runs": {name: summary}, "skipped": {name: reason}}``."""
    from megarl.bench import report
    from megarl.bench.run import run_strategy

    runs: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    longest = 0.0
    for name in strategies:
        left = deadline - time.monotonic()
        if left <= 0 or (longest and longest > left):
            skipped[name] = f"time budget: {max(left, 0):.0f} s left, a run took up to {longest:.0f} s"
            log(f"[cost] {name}: skipped ({skipped[name]})")
            continue
        log(f"[cost] {name}: {steps} steps ...")
        t0 = time.monotonic()
        r = run_strategy({"config": config, "overrides": overrides, "strategy": name, "steps": steps,
                          "run_dir": str(out / name), "verify": False}, pool)
        took = time.monotonic() - t0
        longest = max(longest, took)
        summary = report.summarize(r["records"], r["weights_nbytes"], r["child"]["peak_rss_mb"], verified=False)
        stall = report.publish_stall(r["records"])
        runs[name] = {**summary, "added_step_s": critical_s_median(r["records"]),
                      "publish_stall_s_median": stall["stall"] if stall else None, "run_s": took}
        log(f"[cost] {name}: step {summary['step_time_s_median']:.3f} s (median), own work "
            f"{runs[name]['added_step_s']:.3f} s, peak RSS {summary['peak_rss_mb']:.0f} MB, {took:.0f} s")
    diff = step_minus_behav_s(runs)
    for name, r in runs.items():
        r["step_minus_behav_s"] = diff[name]
    return {"steps": steps, "runs": runs, "skipped": skipped}


def planned_memory(cfg: Any, overrides: list[str], host_memory_gb: float | None = None) -> dict[str, Any]:
    """Per strategy of the cost model: planned extra memory and whether it fits (module doc); ``overrides``: the
    command line's, which tell the model fields where model.checkpoint was pointed elsewhere."""
    from megarl.launch import cluster, cost, memory
    from megarl.launch.placement import load_hf_config, resolve_plan
    from megarl.losses.policy import normalizer_needs_anchor

    hf, _ = load_hf_config(cfg, overrides)
    p = cfg.placement
    plan = resolve_plan(cfg, hf, cluster.simulated(p.trainer_nodes + p.engine_nodes, p.gpus_per_node))
    costs = cost.strategy_costs(cfg, hf, plan, cost.Assumptions(),
                                interpolation_forward=normalizer_needs_anchor(cfg.loss))
    host_gb = machine_memory_gb() if host_memory_gb is None else host_memory_gb
    gpu_gb = float(p.gpu_memory_gb)
    on_gpu = plan.device == "gpu"
    trainer_peak = memory.trainer_memory(cfg, hf, plan.trainer).peak / GB if on_gpu else 0.0
    out: dict[str, Any] = {"device": plan.device, "host_memory_gb": host_gb, "gpu_memory_gb": gpu_gb,
                           "trainer_gpu_peak_gb": trainer_peak, "strategies": {}}
    for name, c in costs.items():
        host = c["host_bytes_per_trainer_node"] / GB
        gpu = trainer_peak + c["gpu_bytes_per_trainer_gpu"] / GB
        scorer = c["dedicated_gpu_bytes"] / GB
        problems = []
        if host > host_gb:
            problems.append(f"host {host:.1f} GB / node > {host_gb:.1f} GB")
        if on_gpu and gpu > gpu_gb:
            problems.append(f"trainer GPU {gpu:.1f} GB > {gpu_gb:g} GB")
        if on_gpu and scorer > gpu_gb:
            problems.append(f"scorer GPU {scorer:.1f} GB > {gpu_gb:g} GB")
        out["strategies"][name] = {"host_gb_per_node": host, "trainer_gpu_gb": gpu if on_gpu else None,
                                   "dedicated_gpus": c["dedicated_gpus"], "dedicated_gpu_gb": scorer,
                                   "planned_stall_s_per_publish": c["stall_s_per_publish"],
                                   "fits": not problems, "problems": problems}
    return out
