"""`megarl bench --quality`'s raw per-run summary (runs.jsonl) and the report tables derived from it alone.

A grid's report rests on a few numbers per run; runs.jsonl keeps exactly those, one JSON line per run, so
that a committed grid can be re-derived (``megarl bench --quality --from-runs runs.jsonl``) without its
run directories or rerunning anything. A line (:func:`run_summary`):

- ``strategy`` (the variant's label), ``eta``, ``seed`` (``trainer.seed``);
- ``final_reward``: mean batch reward over the last ``window`` steps;
- ``steps_to_threshold``: first step whose ``smooth``-step moving average reaches ``threshold``, null if none;
  ``threshold`` and ``threshold_source`` say which reward that was and why (``THRESHOLD_OF_BEST`` x the best
  cell's mean final-window reward unless ``--threshold`` gave it);
- ``r_d``: mean over the steps of ``r_d/abs_logp_mean`` (|logp_old - logp_behav|), null where not logged
  (only exact strategies know logp_old);
- ``active_share_mean`` / ``active_share_min``: the loss's ``active_frac`` over the steps;
  ``downweighted_share`` / ``masked_share``: means of ``behav_w/downweighted_frac`` / ``behav_w/masked_frac``;
- ``anchor_behav_gap_median`` / ``anchor_behav_gap_max``: median and max over the steps of the loss's
  per-step ``abs_logp_anchor_minus_behav_mean`` (|logp_anchor - logp_behav|);
- ``eval_pass1``: pass@1 of the run's last evaluation (null without evaluations);
- ``wall_s``: the training loop's wall time (verifier time removed), ``steps``: optimizer steps logged;
  ``window`` and ``smooth``.

Any diagnostic a run did not log is null. From these lines (:func:`runs_report`): per cell the final reward's
per-seed values, mean and sample standard deviation, the median wall time, steps to threshold and pass@1;
and each cell's difference to behav at the same eta with a t interval (megarl/bench/quality_stats.py:
paired by seed when both cells ran the same seeds, Welch otherwise). The same renderers write these tables
into report.md, so the re-derived tables are those of the report.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from megarl.bench.plots import moving_average
from megarl.bench.quality_stats import (
    DIFF_LEVEL,
    MIN_SEEDS_TO_CALL,
    TOO_FEW,
    call_differences,
    diff_interval,
    logged_values,
    steps_to_threshold,
    threshold_summary,
)
from megarl.bench.report import step_phases
from megarl.errors import ConfigError

RUNS_FILE = "runs.jsonl"
THRESHOLD_OF_BEST = 0.5
"""Default reward threshold: this fraction of the highest mean final-window reward of any cell."""
DEFAULT_THRESHOLD_SOURCE = f"{THRESHOLD_OF_BEST} x the best cell's mean final-window reward"
FIELDS = ("strategy", "eta", "seed", "final_reward", "steps_to_threshold", "threshold", "threshold_source",
          "r_d", "active_share_mean", "active_share_min", "downweighted_share", "masked_share",
          "anchor_behav_gap_median", "anchor_behav_gap_max", "eval_pass1", "wall_s", "steps", "window", "smooth")
GRID_FIELDS = ("threshold", "threshold_source", "window", "smooth")
"""Fields every line of one grid shares."""


# -- a run's metrics.jsonl lines ------------------------------------------------------------------------
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


def final_window_reward(records: list[dict[str, Any]], window: int) -> float:
    """Mean batch reward over the last ``window`` steps (all of them when there are fewer)."""
    return statistics.fmean(rewards(records)[-window:])


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_summary(records: list[dict[str, Any]], *, strategy: str, eta: int, seed: int, window: int, smooth: int,
                threshold: float, threshold_source: str) -> dict[str, Any]:
    """One line of runs.jsonl (module doc) from a run's metrics.jsonl lines (evaluation lines included)."""
    steps = step_records(records)
    if not steps:
        raise ValueError(f"the {strategy} eta={eta} seed={seed} run logged no step")
    active = logged_values(steps, "active_frac")
    gap = logged_values(steps, "abs_logp_anchor_minus_behav_mean")
    return {"strategy": strategy, "eta": eta, "seed": seed, "final_reward": final_window_reward(steps, window),
            "steps_to_threshold": steps_to_threshold(moving_average(rewards(steps), smooth), threshold),
            "threshold": threshold, "threshold_source": threshold_source,
            "r_d": _mean(logged_values(steps, "r_d/abs_logp_mean")),
            "active_share_mean": _mean(active), "active_share_min": min(active) if active else None,
            "downweighted_share": _mean(logged_values(steps, "behav_w/downweighted_frac")),
            "masked_share": _mean(logged_values(steps, "behav_w/masked_frac")),
            "anchor_behav_gap_median": statistics.median(gap) if gap else None,
            "anchor_behav_gap_max": max(gap) if gap else None,
            "eval_pass1": last_eval_pass1(records), "wall_s": step_phases(steps)[-1]["wall"], "steps": len(steps),
            "window": window, "smooth": smooth}


def grid_summaries(runs_by_cell: dict[tuple[str, int], list[list[dict]]], *, window: int, smooth: int,
                   threshold: float | None = None,
                   seeds: dict[tuple[str, int], list[int]] | None = None) -> list[dict[str, Any]]:
    """Every run's line, cell by cell. ``seeds``: per cell, the ``trainer.seed`` of each of its runs; without
    it the i-th run of a cell is seed i, the order run_quality runs them in. The threshold defaults to
    ``THRESHOLD_OF_BEST`` x the highest mean final-window reward of any cell."""
    steps = {cell: [step_records(r) for r in runs] for cell, runs in runs_by_cell.items()}
    source = "--threshold" if threshold is not None else DEFAULT_THRESHOLD_SOURCE
    if threshold is None:
        threshold = THRESHOLD_OF_BEST * max(statistics.fmean(final_window_reward(r, window) for r in runs)
                                            for runs in steps.values())
    out = []
    for (strategy, eta), runs in runs_by_cell.items():
        cell_seeds = list(range(len(runs))) if seeds is None else list(seeds[(strategy, eta)])
        if len(cell_seeds) != len(runs) or len(set(cell_seeds)) != len(cell_seeds):
            raise ValueError(f"{strategy} eta={eta}: seeds {cell_seeds} do not name its {len(runs)} runs once each")
        out += [run_summary(r, strategy=strategy, eta=eta, seed=s, window=window, smooth=smooth,
                            threshold=threshold, threshold_source=source) for s, r in zip(cell_seeds, runs)]
    return out


# -- runs.jsonl ---------------------------------------------------------------------------------------
def write_runs(path: str | Path, runs: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in runs))


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a runs.jsonl, checked: every field present, one grid's settings, each run once."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        why = "no such file" if isinstance(e, FileNotFoundError) else (e.strerror or str(e))
        raise ConfigError(f"{path}: {why}; give the runs.jsonl of `megarl bench --quality`") from None
    runs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path}:{i}: not a JSON line ({e})") from None
        missing = [f for f in FIELDS if not isinstance(run, dict) or f not in run]
        if missing:
            raise ConfigError(f"{path}:{i}: a runs.jsonl line needs {', '.join(missing)}")
        runs.append(run)
    if not runs:
        raise ConfigError(f"{path}: holds no run")
    for f in GRID_FIELDS:
        if len({json.dumps(r[f]) for r in runs}) > 1:
            raise ConfigError(f"{path}: the lines disagree on {f}; runs.jsonl holds one grid")
    keys = [(r["strategy"], r["eta"], r["seed"]) for r in runs]
    twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
    if twice:
        raise ConfigError(f"{path}: run(s) {twice} appear more than once")
    return runs


# -- the tables ---------------------------------------------------------------------------------------
def cell_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (strategy, eta), in the order of first appearance, the per-run numbers over its seeds."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["strategy"], r["eta"]), []).append(r)
    rows = []
    for (strategy, eta), rs in cells.items():
        per_seed = [r["final_reward"] for r in rs]
        pass1 = [r["eval_pass1"] for r in rs]
        pass1 = None if None in pass1 else pass1
        rows.append({"strategy": strategy, "eta": eta, "seeds": [r["seed"] for r in rs], "per_seed": per_seed,
                     "mean": statistics.fmean(per_seed),
                     "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                     "wall_s_median": statistics.median(r["wall_s"] for r in rs),
                     "steps_to_threshold": threshold_summary([r["steps_to_threshold"] for r in rs]),
                     "eval_pass1_per_seed": pass1,
                     "eval_pass1_mean": None if pass1 is None else statistics.fmean(pass1)})
    return rows


def behav_diffs(rows: list[dict[str, Any]], level: float = DIFF_LEVEL) -> list[dict[str, Any]]:
    """Each non-behav cell's final-window reward minus behav's at its eta, with the t interval of
    quality_stats.diff_interval (None with too few seeds); cells whose eta has no behav get none. The verdicts
    are quality_stats.call_differences over all of them: none below 5 seeds a side, Holm over the grid."""
    behav = {r["eta"]: dict(zip(r["seeds"], r["per_seed"])) for r in rows if r["strategy"] == "behav"}
    out = []
    for r in rows:
        if r["strategy"] == "behav" or r["eta"] not in behav:
            continue
        ref = behav[r["eta"]]
        iv = diff_interval(dict(zip(r["seeds"], r["per_seed"])), ref, level=level)
        out.append({"strategy": r["strategy"], "eta": r["eta"], "diff": r["mean"] - statistics.fmean(ref.values()),
                    "n_cell": len(r["per_seed"]), "n_behav": len(ref), "interval": iv})
    for d, verdict in zip(out, call_differences([d["interval"] for d in out], level)):
        d["verdict"] = verdict
    return out


def runs_report(runs: list[dict[str, Any]], level: float = DIFF_LEVEL) -> dict[str, Any]:
    """The tables' numbers from runs.jsonl lines alone (module doc)."""
    rows = cell_rows(runs)
    return {"final": rows, "vs_behav": behav_diffs(rows, level), "level": level, "n_runs": len(runs),
            **{f: runs[0][f] for f in GRID_FIELDS}}


def _f(x: float | None, fmt: str = ".4f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def final_reward_table(q: dict[str, Any]) -> list[str]:
    out = [f"## Final-window reward (mean batch reward over the last {q['window']} steps)", "",
           "| strategy | eta | mean over seeds | std over seeds | per seed | wall s (median) | seeds |",
           "|---|---|---|---|---|---|---|"]
    for r in q["final"]:
        out.append(f"| {r['strategy']} | {r['eta']} | {r['mean']:.4f} | {r['std']:.4f} | "
                   f"{', '.join(f'{x:.4f}' for x in r['per_seed'])} | {r['wall_s_median']:.1f} | "
                   f"{', '.join(str(s) for s in r['seeds'])} |")
    return out


def threshold_table(q: dict[str, Any]) -> list[str]:
    out = [f"## Steps to reward {q['threshold']:.4f} ({q['threshold_source']}; {q['smooth']}-step moving average)",
           "", "| strategy | eta | reached | median | mean of those that reached it | per seed |",
           "|---|---|---|---|---|---|"]
    for r in q["final"]:
        t = r["steps_to_threshold"]
        per = ", ".join("not reached" if s is None else str(s) for s in t["per_seed"])
        median = _f(t["median"], ".1f", "not reached")
        out.append(f"| {r['strategy']} | {r['eta']} | {t['reached']}/{t['of']} | {median} | {_f(t['mean'], '.1f')} | "
                   f"{per} |")
    return out


def eval_table(q: dict[str, Any]) -> list[str]:
    """Held-out pass@1; no lines when no cell evaluated on every seed."""
    with_eval = [r for r in q["final"] if r.get("eval_pass1_per_seed") is not None]
    if not with_eval:
        return []
    out = ["## Held-out pass@1 at the last evaluation", "",
           "| strategy | eta | mean over seeds | per seed | seeds |", "|---|---|---|---|---|"]
    for r in with_eval:
        out.append(f"| {r['strategy']} | {r['eta']} | {r['eval_pass1_mean']:.4f} | "
                   f"{', '.join(f'{x:.4f}' for x in r['eval_pass1_per_seed'])} | {len(r['eval_pass1_per_seed'])} |")
    return out


def vs_behav_table(q: dict[str, Any]) -> list[str]:
    """The differences to behav; no lines when no cell has a behav at its eta."""
    if not q["vs_behav"]:
        return []
    pct = f"{q['level']:.0%}"
    out = [f"## Final-window reward minus behav's at the same eta ({pct} t interval over seeds)", "",
           f"| strategy | eta | difference | {pct} interval | n | method | df | verdict |",
           "|---|---|---|---|---|---|---|---|"]
    for d in q["vs_behav"]:
        iv = d["interval"]
        if iv is None:
            span, n, method, df = TOO_FEW, f"{d['n_cell']} vs {d['n_behav']}", "-", "-"
        else:
            span = f"[{iv['low']:+.4f}, {iv['high']:+.4f}]"
            n = f"{iv['n']} pairs" if iv["method"] == "paired t" else f"{iv['n_a']} vs {iv['n_b']}"
            method, df = iv["method"], f"{iv['df']:.1f}"
        out.append(f"| {d['strategy']} | {d['eta']} | {d['diff']:+.4f} | {span} | {n} | {method} | {df} | "
                   f"{d['verdict']} |")
    out += ["", "paired t: both cells ran the same seeds (trainer.seed), the interval is on the per-seed differences "
            "(n pairs, n - 1 df); Welch t: the seed sets differ, n is this cell's seeds vs behav's (Welch-"
            "Satterthwaite df). Both need 2 seeds a side. At n = 3 such an interval is wide: 'no difference "
            "detectable at this n' says the seeds cannot tell the cells apart, not that they are equal. "
            f"A difference is called only at {MIN_SEEDS_TO_CALL} or more seeds a side ('not called at n < "
            f"{MIN_SEEDS_TO_CALL}' below) and when it survives Holm's step-down correction over the "
            f"{len(q['vs_behav'])} comparisons of this table at alpha = {1 - q['level']:.2f}."]
    return out


def render_runs_markdown(q: dict[str, Any], source: str | Path) -> str:
    """The report's tables re-derived from a runs.jsonl (``q``: :func:`runs_report` of its lines)."""
    out = ["# megarl bench --quality, re-derived from runs.jsonl", "",
           f"{q['n_runs']} runs in {len(q['final'])} cells, read from `{source}`; nothing was rerun. The curves "
           "and the diagnostics pooled over steps need the runs' metrics and are in the grid's report.md.", ""]
    for table in (final_reward_table(q), threshold_table(q), eval_table(q), vs_behav_table(q)):
        out += [*table, ""] if table else []
    return "\n".join(out)
