"""`megarl bench --quality`: does an exact anchor change what the policy learns?

Strategy variants x etas x seeds (default: behav, recompute, loglinear, ewma,
snapshot, interrupt_sync; eta 1 and 8; seeds 0, 1, 2 as ``trainer.seed``,
which sets the data order and the sampling seeds; the initial weights are the
same), one real training run each (megarl/bench/run.py, no verifier). A variant
is a strategy with options, e.g. ``ewma:auto_reset=false`` (megarl/bench/variants.py).
Use a config where staleness matters (configs/bench_quality_cpu.yaml says how
its settings were chosen); ``rollout.dtype=bfloat16`` gives engines whose
log-probs differ from the float32 trainer's.

Resumable: each run directory ``runs/<variant>_eta<eta>_seed<seed>`` gets a
``done.json`` once its run has finished, holding the resolved run config. A later
call with the same ``--output`` reuses every run whose done.json holds the config
it would run now and whose metrics.jsonl holds exactly the steps 1..steps; any other
run is started again from scratch (a stopped grid loses only its unfinished run).

Per (variant, eta) over the seeds (:func:`curve`): the mean batch reward per step,
smoothed by a trailing ``smooth``-step moving average, its mean over the seeds and
the lowest and highest seed at each step, against the step and against the seeds'
mean wall time at that step, and the loss's active-token share; the steps are those
every seed reached. Every run is also summarized in one line of
``<output>/runs.jsonl`` (megarl/bench/quality_runs.py), and the per-cell tables come
from those lines alone, so ``--from-runs`` re-derives them: :func:`final_table`
gives each seed's mean reward over the last ``window`` steps, their mean and sample
standard deviation, the median wall time and the steps to a reward threshold, plus
the diagnostics pooled over every step of the cell's runs
(megarl/bench/quality_stats.py). The threshold defaults to half the highest mean
final-window reward of any cell in the grid (``quality_runs.THRESHOLD_OF_BEST``):
"how soon does a variant get halfway to what the best one ends at". The report's
``vs_behav``: each cell's final-window reward minus behav's at the same eta, with a
90% t interval over seeds, paired by seed when both cells ran the same seeds,
Welch's otherwise (quality_stats.diff_interval), and what it lets one say.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from megarl.bench.plots import moving_average
from megarl.bench.quality_runs import (
    RUNS_FILE,
    eval_table,
    final_reward_table,
    grid_summaries,
    rewards,
    runs_report,
    step_records,
    threshold_table,
    vs_behav_table,
    write_runs,
)
from megarl.bench.quality_stats import DIFF_LEVEL, cell_diagnostics
from megarl.bench.report import load_metrics, step_phases
from megarl.bench.variants import Variant
from megarl.errors import ConfigError

DEFAULT_STRATEGIES = ("behav", "recompute", "loglinear", "ewma", "snapshot", "interrupt_sync")
DEFAULT_ETAS = (1, 8)
DEFAULT_SEEDS = 3
DONE = "done.json"


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


def _with_diagnostics(rows: list[dict[str, Any]], steps_by_cell: dict[tuple[str, int], list[list[dict]]]):
    """The cell rows of quality_runs.cell_rows with the diagnostics pooled over the cell's steps added."""
    out = []
    for row in rows:
        runs = steps_by_cell[(row["strategy"], row["eta"])]
        diag = cell_diagnostics(runs, min(len(r) for r in runs))
        diag.pop("active_frac_curve")  # a curve: it goes with the reward curves
        out.append({**row, **diag})
    return out


def final_table(runs_by_cell: dict[tuple[str, int], list[list[dict]]], window: int, smooth: int = 5,
                threshold: float | None = None, seeds: dict[tuple[str, int], list[int]] | None = None
                ) -> list[dict[str, Any]]:
    """Per cell (module docstring); a run's records may hold its evaluations' lines too: the steps' records
    make the curves, the last evaluation gives ``eval_pass1_*`` (None without evaluations). ``seeds``: as in
    quality_runs.grid_summaries."""
    summaries = grid_summaries(runs_by_cell, window=window, smooth=smooth, threshold=threshold, seeds=seeds)
    steps = {cell: [step_records(r) for r in runs] for cell, runs in runs_by_cell.items()}
    return _with_diagnostics(runs_report(summaries)["final"], steps)


def build_quality_report(runs_by_cell: dict[tuple[str, int], list[list[dict]]], *, window: int, smooth: int,
                         meta: dict[str, Any], threshold: float | None = None,
                         seeds: dict[tuple[str, int], list[int]] | None = None,
                         level: float = DIFF_LEVEL) -> dict[str, Any]:
    """The report: curves and the tables of quality_runs.runs_report with the pooled diagnostics; ``runs``
    holds the runs.jsonl lines it rests on."""
    summaries = grid_summaries(runs_by_cell, window=window, smooth=smooth, threshold=threshold, seeds=seeds)
    steps = {cell: [step_records(r) for r in runs] for cell, runs in runs_by_cell.items()}
    curves = [{"strategy": s, "eta": e, **curve(runs, smooth),
               "active_frac": cell_diagnostics(runs, min(len(r) for r in runs))["active_frac_curve"]}
              for (s, e), runs in steps.items()]
    tables = runs_report(summaries, level)
    tables["final"] = _with_diagnostics(tables["final"], steps)
    return {"quality": {"curves": curves, **tables}, "runs": summaries, "meta": meta}


def _f(x: float | None, fmt: str = ".4f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def render_quality_markdown(rep: dict[str, Any]) -> str:
    q, meta = rep["quality"], rep["meta"]
    seeds = meta.get("seeds", [])
    out = ["# megarl bench --quality", "",
           f"Config `{meta.get('config', '?')}`, {meta.get('steps', '?')} steps per run, seeds {seeds} "
           f"(trainer.seed), {meta.get('cpu_count', '?')} CPUs (load average {meta.get('loadavg_start', 0):.2f} "
           f"at the start, {meta.get('loadavg_end', 0):.2f} at the end). One line per run in `{RUNS_FILE}`: "
           f"`megarl bench --quality --from-runs {RUNS_FILE}` re-derives the tables of rewards, steps, pass@1 and "
           "differences from it alone.", "", *final_reward_table(q), "", *threshold_table(q)]
    out += ["", "## Log-prob distances and the loss's tokens (means over every step of every seed)", "",
            "| strategy | eta | r_d: abs(logp_old - logp_behav) | abs(logp_anchor - logp_behav) | active share min "
            "(mean over seeds) | active share min (any seed) | masked share | down-weighted share |",
            "|---|---|---|---|---|---|---|---|"]
    for r in q["final"]:
        r_d = _f(r["r_d_abs_logp_mean"], ".2e", "not logged (inexact anchor)")
        out.append(f"| {r['strategy']} | {r['eta']} | {r_d} | "
                   f"{_f(r['abs_logp_anchor_minus_behav_mean'], '.2e')} | {_f(r['active_frac_min'])} | "
                   f"{_f(r['active_frac_min_any_seed'])} | {_f(r['masked_frac_mean'])} | "
                   f"{_f(r['downweighted_frac_mean'])} |")
    out += ["", "r_d is logged only where logp_old is known (exact strategies); abs(logp_anchor - logp_behav) is "
            "what the loss's train-inference weight sees, for every strategy. '-': not logged (loglinear and linear "
            "build their anchor inside the loss, so only its active share is known)."]
    for table in (eval_table(q), vs_behav_table(q)):
        out += ["", *table] if table else []
    out += ["", f"`quality.png`: reward vs step and vs wall time ({q['smooth']}-step moving average; line: mean over "
            "seeds, band: lowest to highest seed) and the loss's active-token share vs step (mean over seeds).", ""]
    return "\n".join(out)


# -- the grid, resumable ---------------------------------------------------------------------------------
def cell_spec(config: str, variant: Variant, eta: int, seed: int, steps: int, output: str,
              overrides: list[str]) -> dict[str, Any]:
    """What :func:`megarl.bench.run.run_strategy` gets for one run of the grid."""
    return {"config": config, "strategy": variant.name, "steps": steps, "verify": False,
            "run_dir": str(Path(output) / "runs" / f"{variant.dirname}_eta{eta}_seed{seed}"),
            "overrides": [*overrides, *variant.overrides(), f"rollout.eta={eta}", f"trainer.seed={seed}"]}


def resolved_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The run's resolved config as plain JSON data, without its output directory (it names the run dir)."""
    from megarl.bench.run import child_config  # lazy: the training loop's imports
    from megarl.config.loader import to_dict

    cfg = json.loads(json.dumps(to_dict(child_config(spec))))
    cfg["logging"].pop("output_dir", None)
    return cfg


def finished_records(spec: dict[str, Any], config: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The records of a finished run of ``spec`` whose done.json holds ``config``; None when it must (re)run."""
    run_dir = Path(spec["run_dir"])
    try:
        done = json.loads((run_dir / DONE).read_text())
        records = load_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return None
    steps = [r.get("step") for r in step_records(records)]
    if done.get("config") != config or steps != list(range(1, spec["steps"] + 1)):
        return None
    return records


def plan(config: str, variants: list[Variant], etas: list[int], seeds: int, steps: int, output: str,
         overrides: list[str]) -> list[dict[str, Any]]:
    """Every run of the grid: ``{"variant", "eta", "seed", "spec", "config", "records"}``, records set when
    a finished run can be reused."""
    cells = []
    for v in variants:
        for eta in etas:
            for seed in range(seeds):
                spec = cell_spec(config, v, eta, seed, steps, output, overrides)
                cfg = resolved_config(spec)
                cells.append({"variant": v, "eta": eta, "seed": seed, "spec": spec, "config": cfg,
                              "records": finished_records(spec, cfg)})
    return cells


def run_quality(config: str, variants: list[Variant], etas: list[int], seeds: int, steps: int, output: str,
                overrides: list[str], *, run: Callable[[dict], dict], meta: dict[str, Any], window: int,
                smooth: int = 5, threshold: float | None = None, log=print) -> dict[str, Any]:
    """Every (variant, eta, seed) in turn (``run``: megarl.bench.run.run_strategy) unless a finished run can be
    reused, then the report, runs.jsonl and quality.png under ``output``."""
    from megarl.bench import plots  # lazy: matplotlib

    if seeds < 1 or not variants or not etas:
        raise ConfigError("--quality needs at least one strategy, one eta and --seeds >= 1")
    if window < 1:
        raise ConfigError(f"--final-window={window} must be >= 1")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    cells = plan(config, variants, etas, seeds, steps, output, overrides)
    reused = sum(c["records"] is not None for c in cells)
    if reused:
        log(f"reusing {reused} of {len(cells)} runs finished before under {out / 'runs'}")
    runs_by_cell: dict[tuple[str, int], list[list[dict]]] = {}
    seeds_by_cell: dict[tuple[str, int], list[int]] = {}
    for i, c in enumerate(cells, 1):
        head = f"[{i}/{len(cells)}] {c['variant'].label} eta={c['eta']} seed={c['seed']}"
        run_dir = Path(c["spec"]["run_dir"])
        if c["records"] is not None:
            log(f"{head}: finished before, reused ({run_dir})")
        else:
            log(f"{head} ...")
            (run_dir / DONE).unlink(missing_ok=True)  # a stale mark must not outlive the run it described
            c["records"] = run(c["spec"])["records"]
            (run_dir / DONE).write_text(json.dumps({"label": c["variant"].label, "eta": c["eta"], "seed": c["seed"],
                                                    "steps": steps, "config": c["config"]}) + "\n")
        runs_by_cell.setdefault((c["variant"].label, c["eta"]), []).append(c["records"])
        seeds_by_cell.setdefault((c["variant"].label, c["eta"]), []).append(c["seed"])
    rep = build_quality_report(runs_by_cell, window=window, smooth=smooth, threshold=threshold, seeds=seeds_by_cell,
                               meta={**meta, "seeds": list(range(seeds)), "reused_runs": reused})
    write_runs(out / RUNS_FILE, rep["runs"])
    plots.quality_plot(rep, out / "quality.png")
    return rep
