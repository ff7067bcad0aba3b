"""What each strategy costs on this setup: measured step time (`megarl bench`'s runs) and planned memory.

Time. Each strategy trains a few steps through `megarl bench`'s own machinery
(:func:`megarl.bench.run.run_strategy`: a fresh process per run on the shared
engines, without the verifier), and :func:`megarl.bench.report.summarize` and
:func:`~megarl.bench.report.publish_stall` read its metrics: the median step
over steps 2..N, the strategy's own anchor time and the median publish stall.
A strategy's added step time (``added_step_s``) is the median over steps 2..N
of the seconds of its own work the trainer loop waits for (bench's
``critical``: its anchor, dedicated's waits for its scorer included, its
publish-time scoring and its hooks). The runs are repeated in interleaved
rounds (megarl/bench/interleave.py: every strategy once per round in
:data:`ORDER`, behav first as the baseline, the order reversed every other
round), so load that comes and goes falls on every strategy in turn; each
number is the median over the repeats, and the shares and differences the
rules compare carry a 90% t interval over them (:func:`over_repeats`).
``step_minus_behav_s`` is the median per-round difference of the step to
behav's, which also holds the noise of the batch waits. In round 1 a strategy
whose run would not fit in what is left of the time budget (estimated from
the longest run so far) is skipped and listed as such; a later round runs
only when all of it fits.

Memory. The cost model of `megarl plan --cost` (megarl/launch/cost.py) on the
config's placement gives each strategy's extra host bytes per trainer node,
GPU bytes per trainer GPU and the dedicated scorer's GPU; on GPU plans the
trainer GPU's own peak comes from megarl/launch/memory.py. A strategy fits
when its host bytes fit ``host_memory_gb`` (default: this machine's memory)
and, on GPUs, its trainer GPU and scorer GPU fit ``placement.gpu_memory_gb``.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

#: the order in which strategies are timed: the baseline, then the cheapest anchors, then the exact ones
ORDER = ("behav", "loglinear", "recompute", "ewma", "linear", "snapshot", "interrupt_sync", "dedicated")
GB = 1e9


def machine_memory_gb() -> float:
    """This machine's physical memory, GB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def critical_s_median(records: list[dict[str, Any]]) -> float:
    """Median over steps 2..N of the strategy's critical-path seconds (megarl/bench/report.py's ``critical``)."""
    from megarl.bench import report

    phases = report.step_phases(records)
    steady = phases[1:] or phases
    return statistics.median(p["critical"] for p in steady)


def _summary(r: dict[str, Any], took: float) -> dict[str, Any]:
    """One timing run's numbers (module doc)."""
    from megarl.bench import report

    summary = report.summarize(r["records"], r["weights_nbytes"], r["child"]["peak_rss_mb"], verified=False)
    stall = report.publish_stall(r["records"])
    return {**summary, "added_step_s": critical_s_median(r["records"]),
            "publish_stall_s_median": stall["stall"] if stall else None, "run_s": took}


def over_repeats(per: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per strategy, its repeats' numbers combined (megarl/bench/interleave.py: medians, the largest peak and run
    time), ``per_repeat`` (each repeat's added and step seconds), ``share_interval`` (added / step per repeat, t
    interval) and, beside behav's runs of the same rounds, ``step_minus_behav_s`` (the median of the per-round
    differences), its t interval and ``step_ratio_to_behav`` (the per-round ratio, t interval on the log)."""
    from megarl.bench import interleave

    behav = per.get("behav")
    out: dict[str, dict[str, Any]] = {}
    for name, runs in per.items():
        one = {k: interleave.combine([x[k] for x in runs], k) for k in runs[0]}
        steps = [x["step_time_s_median"] for x in runs]
        one["per_repeat"] = [{"added_step_s": x["added_step_s"], "step_time_s_median": x["step_time_s_median"]}
                          for x in runs]
        one["share_interval"] = interleave.share_interval([x["added_step_s"] for x in runs], steps)
        one["step_minus_behav_s"] = one["step_minus_behav_interval"] = one["step_ratio_to_behav"] = None
        if behav is not None and len(behav) == len(runs):
            base = [x["step_time_s_median"] for x in behav]
            diffs = [a - b for a, b in zip(steps, base)]
            one["step_minus_behav_s"] = statistics.median(diffs)
            one["step_minus_behav_interval"] = interleave.t_interval(diffs)
            one["step_ratio_to_behav"] = interleave.ratio_interval(steps, base)
        out[name] = one
    return out


def time_strategies(config: str, overrides: list[str], strategies: list[str], steps: int, out: Path, pool: Any,
                    deadline: float, log: Callable[[str], None] = print, repeats: int = 3,
                    run: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None,
                    now: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Time each of ``strategies`` for ``steps`` steps, ``repeats`` interleaved rounds (megarl/bench/interleave.py),
    while ``deadline`` (time.monotonic) allows: in round 1 a strategy whose run would not fit is skipped; a later
    round runs only when all of it fits. ``run``: megarl/bench/run.py ``run_strategy`` unless given; ``now``: the
    clock of ``deadline``. Returns
    ``{"steps", "repeats", "repeats_done", "order", "runs": {name: summary}, "skipped": {name: reason}}``."""
    from megarl.bench.interleave import schedule

    if run is None:
        from megarl.bench.run import run_strategy as run
    per: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    done, longest, order = 0, 0.0, schedule(list(strategies), repeats)
    for rnd in range(repeats):
        names = [n for r, n in order if r == rnd and (rnd == 0 or n in per)]
        left = deadline - now()
        if rnd and longest * len(names) > left:
            log(f"[cost] repeat {rnd + 1} of {repeats}: not started (time budget: {max(left, 0):.0f} s left, a "
                f"round takes about {longest * len(names):.0f} s)")
            break
        for name in names:
            left = deadline - now()
            if not rnd and (left <= 0 or (longest and longest > left)):
                skipped[name] = f"time budget: {max(left, 0):.0f} s left, a run took up to {longest:.0f} s"
                log(f"[cost] {name}: skipped ({skipped[name]})")
                continue
            log(f"[cost] {name}: {steps} steps (repeat {rnd + 1} of {repeats}) ...")
            t0 = now()
            run_dir = out / name if rnd == 0 else out / "repeats" / f"{name}_{rnd + 1}"
            r = run({"config": config, "overrides": overrides, "strategy": name, "steps": steps,
                     "run_dir": str(run_dir), "verify": False}, pool)
            one = _summary(r, now() - t0)
            longest = max(longest, one["run_s"])
            per.setdefault(name, []).append(one)
            log(f"[cost] {name}: step {one['step_time_s_median']:.3f} s (median), own work "
                f"{one['added_step_s']:.3f} s, peak RSS {one['peak_rss_mb']:.0f} MB, {one['run_s']:.0f} s")
        done = rnd + 1
    return {"steps": steps, "repeats": repeats, "repeats_done": done if per else 0,
            "order": [[r, n] for r, n in order if r < done and n in per], "runs": over_repeats(per),
            "skipped": skipped}


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
