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

Per (variant, eta) over the seeds (:func:`curve`): the mean batch reward per
step, smoothed by a trailing ``smooth``-step moving average, its mean over the
seeds and the lowest and highest seed at each step, against the step and
against the seeds' mean wall time at that step, and the loss's active-token
share; the steps are those every seed reached. :func:`final_table` gives each
seed's mean reward over the last ``window`` steps, their mean and sample standard
deviation, the median wall time, the steps to a reward threshold and the logged
diagnostics (megarl/bench/quality_stats.py). The threshold defaults to half the
highest mean final-window reward of any cell in the grid (``THRESHOLD_OF_BEST``):
"how soon does a variant get halfway to what the best one ends at".
:func:`behav_diffs`: each cell's final-window reward minus behav's at the same
eta, with a bootstrap 90% interval over seeds (quality_stats.bootstrap_diff).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from megarl.bench.plots import moving_average
from megarl.bench.quality_stats import bootstrap_diff, cell_diagnostics, steps_to_threshold, threshold_summary
from megarl.bench.report import load_metrics, step_phases
from megarl.bench.variants import Variant
from megarl.errors import ConfigError

DEFAULT_STRATEGIES = ("behav", "recompute", "loglinear", "ewma", "snapshot", "interrupt_sync")
DEFAULT_ETAS = (1, 8)
DEFAULT_SEEDS = 3
THRESHOLD_OF_BEST = 0.5
"""Default reward threshold: this fraction of the highest mean final-window reward of any cell."""
DONE = "done.json"


def is_eval_record(record: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl line is an evaluation's (eval.path set), not a training step's."""
    return any(k.startswith("eval/") for k in record)


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training steps' records of a run's metrics.jsonl lines."""
    return [r for r in records if not is_eval_record(r)]


def last_eval_pass1(records: list[dict[str, Any]]) -> float | None:
    """pass@1 of the run's last evaluation; None when it evaluated nothing."""
    evals = [r for r in records if "eval/pass@1" in r]
    return float(evals[-1]["eval/pass@1"]) if evals else None


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


def default_threshold(runs_by_cell: dict[tuple[str, int], list[list[dict]]], window: int) -> float:
    return THRESHOLD_OF_BEST * max(statistics.fmean(final_window_reward(r, window) for r in runs)
                                   for runs in runs_by_cell.values())


def final_table(runs_by_cell: dict[tuple[str, int], list[list[dict]]], window: int, smooth: int = 5,
                threshold: float | None = None) -> list[dict[str, Any]]:
    """Per cell (module docstring); a run's records may hold its evaluations' lines too: the steps' records
    make the curves, the last evaluation gives ``eval_pass1_*`` (None without evaluations)."""
    evals = {cell: [last_eval_pass1(r) for r in runs] for cell, runs in runs_by_cell.items()}
    runs_by_cell = {cell: [step_records(r) for r in runs] for cell, runs in runs_by_cell.items()}
    threshold = default_threshold(runs_by_cell, window) if threshold is None else threshold
    rows = []
    for (strategy, eta), runs in runs_by_cell.items():
        per_seed = [final_window_reward(r, window) for r in runs]
        pass1 = evals[(strategy, eta)]
        pass1 = None if None in pass1 else pass1
        diag = cell_diagnostics(runs, min(len(r) for r in runs))
        diag.pop("active_frac_curve")  # a curve: it goes with the reward curves
        reach = [steps_to_threshold(moving_average(rewards(r), smooth), threshold) for r in runs]
        rows.append({"strategy": strategy, "eta": eta, "per_seed": per_seed, "mean": statistics.fmean(per_seed),
                     "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                     "wall_s_median": statistics.median(step_phases(r)[-1]["wall"] for r in runs),
                     "steps_to_threshold": threshold_summary(reach),
                     "eval_pass1_per_seed": pass1,
                     "eval_pass1_mean": None if pass1 is None else statistics.fmean(pass1),
                     **diag})
    return rows


def behav_diffs(final: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each non-behav cell's final-window reward minus behav's at its eta (cells whose eta has no behav: none)."""
    behav = {r["eta"]: r["per_seed"] for r in final if r["strategy"] == "behav"}
    return [{"strategy": r["strategy"], "eta": r["eta"], "interval": bootstrap_diff(r["per_seed"], behav[r["eta"]]),
             "diff": r["mean"] - statistics.fmean(behav[r["eta"]])}
            for r in final if r["strategy"] != "behav" and r["eta"] in behav]


def build_quality_report(runs_by_cell: dict[tuple[str, int], list[list[dict]]], *, window: int, smooth: int,
                         meta: dict[str, Any], threshold: float | None = None) -> dict[str, Any]:
    steps = {cell: [step_records(r) for r in runs] for cell, runs in runs_by_cell.items()}
    curves = [{"strategy": s, "eta": e, **curve(runs, smooth),
               "active_frac": cell_diagnostics(runs, min(len(r) for r in runs))["active_frac_curve"]}
              for (s, e), runs in steps.items()]
    given = threshold is not None
    threshold = threshold if given else default_threshold(steps, window)
    final = final_table(runs_by_cell, window, smooth, threshold)
    return {"quality": {"curves": curves, "final": final, "vs_behav": behav_diffs(final), "window": window,
                        "smooth": smooth, "threshold": threshold,
                        "threshold_source": "--threshold" if given else
                        f"{THRESHOLD_OF_BEST} x the best cell's mean final-window reward"}, "meta": meta}


def _f(x: float | None, fmt: str = ".4f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


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
    out += ["", f"## Steps to reward {q['threshold']:.4f} ({q['threshold_source']}; {q['smooth']}-step moving "
            "average)", "", "| strategy | eta | reached | median | mean of those that reached it | per seed |",
            "|---|---|---|---|---|---|"]
    for r in q["final"]:
        t = r["steps_to_threshold"]
        per = ", ".join("not reached" if s is None else str(s) for s in t["per_seed"])
        median = _f(t["median"], ".1f", "not reached")
        out.append(f"| {r['strategy']} | {r['eta']} | {t['reached']}/{t['of']} | {median} | {_f(t['mean'], '.1f')} | "
                   f"{per} |")
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
    with_eval = [r for r in q["final"] if r.get("eval_pass1_per_seed") is not None]
    if with_eval:
        out += ["", "## Held-out pass@1 at the last evaluation", "",
                "| strategy | eta | mean over seeds | per seed | seeds |", "|---|---|---|---|---|"]
        for r in with_eval:
            out.append(f"| {r['strategy']} | {r['eta']} | {r['eval_pass1_mean']:.4f} | "
                       f"{', '.join(f'{x:.4f}' for x in r['eval_pass1_per_seed'])} | {len(r['eval_pass1_per_seed'])} |")
    if q["vs_behav"]:
        out += ["", "## Final-window reward minus behav's at the same eta (bootstrap 90% interval over seeds)", "",
                "| strategy | eta | difference | 90% interval |", "|---|---|---|---|"]
        for d in q["vs_behav"]:
            iv = d["interval"]
            span = "needs >= 2 seeds" if iv is None else f"[{iv['low']:+.4f}, {iv['high']:+.4f}]"
            out.append(f"| {d['strategy']} | {d['eta']} | {d['diff']:+.4f} | {span} |")
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
    reused, then the report and quality.png under ``output``."""
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
    rep = build_quality_report(runs_by_cell, window=window, smooth=smooth, threshold=threshold,
                               meta={**meta, "seeds": list(range(seeds)), "reused_runs": reused})
    plots.quality_plot(rep, out / "quality.png")
    return rep
