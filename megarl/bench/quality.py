"""`megarl bench --quality`: does an exact anchor change what the policy learns?

Strategies x etas x seeds (default: behav, recompute, loglinear, ewma,
snapshot, interrupt_sync; eta 1 and 8; seeds 0, 1, 2 as ``trainer.seed``,
which sets the data order and the sampling seeds; the initial weights are the
same), one real training run each (megarl/bench/run.py, no verifier). Use a
config where staleness matters (configs/bench_quality_cpu.yaml says how its
settings were chosen).

Per (strategy, eta) over the seeds (:func:`curve`): the mean batch reward
per step, smoothed by a trailing ``smooth``-step moving average, its mean
over the seeds and the lowest and highest seed at each step, against the
step and against the seeds' mean wall time at that step; the steps are those
every seed reached. :func:`final_table` gives each seed's mean reward over the
last ``window`` steps, and their mean and sample standard deviation.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

from megarl.bench.plots import moving_average
from megarl.bench.report import step_phases
from megarl.errors import ConfigError

DEFAULT_STRATEGIES = ("behav", "recompute", "loglinear", "ewma", "snapshot", "interrupt_sync")
DEFAULT_ETAS = (1, 8)
DEFAULT_SEEDS = 3


def rewards(records: list[dict[str, Any]]) -> list[float]:
    return [float(r.get("reward_mean") or 0.0) for r in records]


def curve(runs: list[list[dict[str, Any]]], smooth: int) -> dict[str, list[float]]:
    """Mean / lowest / highest smoothed reward over the seeds' runs, per step, with step and mean wall time."""
    n = min(len(r) for r in runs)
    if n == 0:
        raise ValueError("a quality run logged no step")
    smoothed = [moving_average(rewards(r), smooth)[:n] for r in runs]
    walls = [[p["wall"] for p in step_phases(r)][:n] for r in runs]
    return {"step": list(range(1, n + 1)), "wall_s": [statistics.fmean(w[i] for w in walls) for i in range(n)],
            "mean": [statistics.fmean(s[i] for s in smoothed) for i in range(n)],
            "low": [min(s[i] for s in smoothed) for i in range(n)],
            "high": [max(s[i] for s in smoothed) for i in range(n)]}


def final_window_reward(records: list[dict[str, Any]], window: int) -> float:
    """Mean batch reward over the last ``window`` steps (all of them when there are fewer)."""
    return statistics.fmean(rewards(records)[-window:])


def final_table(runs_by_cell: dict[tuple[str, int], list[list[dict]]], window: int) -> list[dict[str, Any]]:
    rows = []
    for (strategy, eta), runs in runs_by_cell.items():
        per_seed = [final_window_reward(r, window) for r in runs]
        rows.append({"strategy": strategy, "eta": eta, "per_seed": per_seed, "mean": statistics.fmean(per_seed),
                     "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                     "wall_s_median": statistics.median(step_phases(r)[-1]["wall"] for r in runs)})
    return rows


def build_quality_report(runs_by_cell: dict[tuple[str, int], list[list[dict]]], *, window: int, smooth: int,
                         meta: dict[str, Any]) -> dict[str, Any]:
    curves = [{"strategy": s, "eta": e, **curve(runs, smooth)} for (s, e), runs in runs_by_cell.items()]
    return {"quality": {"curves": curves, "final": final_table(runs_by_cell, window), "window": window,
                        "smooth": smooth}, "meta": meta}


def render_quality_markdown(rep: dict[str, Any]) -> str:
    q, meta = rep["quality"], rep["meta"]
    seeds = meta.get("seeds", [])
    out = ["# megarl bench --quality", "",
           f"Config `{meta.get('config', '?')}`, {meta.get('steps', '?')} steps per run, seeds {seeds} "
           f"(trainer.seed), {meta.get('cpu_count', '?')} CPUs (load average {meta.get('loadavg_start', 0):.2f} "
           f"at the start, {meta.get('loadavg_end', 0):.2f} at the end).", "",
           f"## Final-window reward (mean batch reward over the last {q['window']} steps)", "",
           "| strategy | eta | mean over seeds | std over seeds | per seed | wall s (median) |",
           "|---|---|---|---|---|---|"]
    for r in q["final"]:
        out.append(f"| {r['strategy']} | {r['eta']} | {r['mean']:.4f} | {r['std']:.4f} | "
                   f"{', '.join(f'{x:.4f}' for x in r['per_seed'])} | {r['wall_s_median']:.1f} |")
    out += ["", f"`quality.png`: reward vs step and vs wall time ({q['smooth']}-step moving average; line: mean over "
            "seeds, band: lowest to highest seed).", ""]
    return "\n".join(out)


def run_quality(config: str, strategies: list[str], etas: list[int], seeds: int, steps: int, output: str,
                overrides: list[str], *, run: Callable[[dict], dict], meta: dict[str, Any], window: int,
                smooth: int = 5, log=print) -> dict[str, Any]:
    """Every (strategy, eta, seed) in turn (``run``: megarl.bench.run.run_strategy), then the report and
    quality.png under ``output``."""
    from megarl.bench import plots  # lazy: matplotlib

    if seeds < 1 or not strategies or not etas:
        raise ConfigError("--quality needs at least one strategy, one eta and --seeds >= 1")
    if window < 1:
        raise ConfigError(f"--final-window={window} must be >= 1")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    runs_by_cell: dict[tuple[str, int], list[list[dict]]] = {}
    total, i = len(strategies) * len(etas) * seeds, 0
    for strategy in strategies:
        for eta in etas:
            for seed in range(seeds):
                i += 1
                log(f"[{i}/{total}] {strategy} eta={eta} seed={seed} ...")
                res = run({"config": config, "strategy": strategy, "steps": steps, "verify": False,
                           "run_dir": str(out / "runs" / f"{strategy}_eta{eta}_seed{seed}"),
                           "overrides": [*overrides, f"rollout.eta={eta}", f"trainer.seed={seed}"]})
                runs_by_cell.setdefault((strategy, eta), []).append(res["records"])
    rep = build_quality_report(runs_by_cell, window=window, smooth=smooth,
                               meta={**meta, "seeds": list(range(seeds))})
    plots.quality_plot(rep, out / "quality.png")
    return rep
