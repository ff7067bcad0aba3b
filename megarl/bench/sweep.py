"""`megarl bench --sweep`: how each strategy's costs grow with model size and with staleness.

The grid is models x etas x strategies (``--models``, ``--etas``,
``--strategies``), one real training run per cell (megarl/bench/run.py, no
verifier), each model a random tiny Qwen3 (configs/models/*.yaml; the
default four span 30x in parameters, dense and MoE). The run time is
estimated and printed before anything starts (``--estimate-only`` stops
there), so a grid can be chosen to fit the time available.

Per cell, over steps 2..N (:func:`sweep_row`): step time and recovery
seconds (medians), extra bytes held (max of ``recovery/bytes_held``; a
dedicated scorer's copy counts one set of weights), bytes moved per step,
the publish stall per publish and its parts (megarl/bench/report.py
``publish_stall``), distinct policy versions per batch (from
``version_lag_hist``), and what a forward over the batch processes
(``bench_seq_tokens``, ``bench_version_seq_tokens``: the cost model's inputs,
megarl/launch/cost.py).

Fits (:func:`fits`): per strategy, recovery seconds against total parameters
at each eta, and against distinct versions per batch for each model, as power
laws ``y = c * x^b`` (megarl/launch/fit.py). Growth with eta (:func:`growth`):
a cost grows with eta when, from the smallest to the largest eta of the grid,
it rises by at least :data:`GROWTH_RATIO` and by more than its noise floor
(:data:`GROWTH_FLOOR`), on at least half of the models.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

import yaml

from megarl.bench import report, report_render
from megarl.errors import ConfigError
from megarl.launch.fit import power_law
from megarl.launch.placement import param_counts

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = ("tiny_qwen3", "tiny_qwen3_s", "tiny_qwen3_m", "tiny_qwen3_moe_m")
DEFAULT_ETAS = (1, 2, 4, 8)
#: a cost grows with eta when it rises at least this many times from the smallest to the largest eta ...
GROWTH_RATIO = 1.5
#: ... and by more than this (seconds, or sets of weights for bytes held): below it, timer and scheduling noise
GROWTH_FLOOR = {"recovery_s_median": 0.002, "extra_bytes_held": 0.5, "stall_per_publish_s": 0.005}
#: run-time estimate per run (seconds): process, engine and trainer start-up, then a step of a + b * active
#: parameters. From 4-step runs of tiny_qwen3, tiny_qwen3_m and tiny_qwen3_moe_m (snapshot, eta 2,
#: configs/bench_cpu.yaml, vLLM engine) on a 2-core machine at load 0.3-1.5: 39 s per run, steps of 0.29 s
#: (0.13M parameters), 1.3 s (2.4M active) and 1.6 s (3.9M). Other strategies and etas differ; an estimate.
ESTIMATE_STARTUP_S = 36.0
ESTIMATE_STEP_S = (0.25, 3.4e-7)


def resolve_model(name: str) -> Path:
    """A model YAML: a path, or a name under configs/models/ (``tiny_qwen3_m``)."""
    for p in (Path(name), REPO / "configs" / "models" / f"{name}.yaml"):
        if p.is_file():
            return p
    known = ", ".join(sorted(p.stem for p in (REPO / "configs" / "models").glob("tiny_*.yaml")))
    raise ConfigError(f"--models: {name!r} is neither a model YAML nor a name under configs/models/ ({known})")


def model_info(path: Path) -> dict[str, Any]:
    """Name, total and active parameters, MoE or dense."""
    hf = yaml.safe_load(path.read_text()) or {}
    total, active = param_counts(hf)
    return {"model": path.stem, "yaml": str(path), "params": total, "active_params": active,
            "moe": bool(hf.get("num_experts"))}


def cells(models: list[dict], etas: list[int], strategies: list[str]) -> list[tuple[dict, int, str]]:
    if not models or not etas or not strategies:
        raise ConfigError("--sweep needs at least one model, one eta and one strategy")
    if min(etas) < 1:
        raise ConfigError(f"--etas {etas}: the sweep measures staleness, give etas >= 1")
    return [(m, e, s) for m in models for e in etas for s in strategies]


def estimate_run_seconds(active_params: int, steps: int) -> float:
    """Rough time of one bench run (:data:`ESTIMATE_STARTUP_S`, :data:`ESTIMATE_STEP_S`)."""
    a, b = ESTIMATE_STEP_S
    return ESTIMATE_STARTUP_S + steps * (a + b * active_params)


def estimate_seconds(grid: list[tuple[dict, int, str]], steps: int) -> float:
    """Rough run time of the whole grid."""
    return sum(estimate_run_seconds(m["active_params"], steps) for m, _, _ in grid)


def sweep_row(records: list[dict[str, Any]], weights_nbytes: int) -> dict[str, Any]:
    """The measured costs of one cell (module doc)."""
    s = report.summarize(records, weights_nbytes, peak_rss_mb=0.0, verified=False)
    steady = records[1:] or records
    held = max((report._num(r, "recovery/bytes_held") for r in records), default=0.0)
    if held == 0.0 and s["extra_param_copies"] > 0:  # a copy held outside this process (the dedicated scorer)
        held = s["extra_param_copies"] * weights_nbytes
    stall = report.publish_stall(records)

    def mean(key: str) -> float:
        return statistics.fmean(report._num(r, key) for r in steady)

    return {"step_time_s_median": s["step_time_s_median"], "recovery_s_median": s["recovery_s_median"],
            "extra_bytes_held": held, "bytes_moved_per_step": s["bytes_moved"] / len(records),
            "stall_per_publish_s": stall["stall"] if stall else None, "stall_parts_s": stall,
            "distinct_versions_mean": statistics.fmean(len(r.get("version_lag_hist") or {}) for r in steady),
            "distinct_versions_max": max(len(r.get("version_lag_hist") or {}) for r in steady),
            "stale_versions_mean": statistics.fmean(
                sum(1 for lag in (r.get("version_lag_hist") or {}) if int(lag) > 0) for r in steady),
            "seq_tokens_mean": mean("recovery/bench_seq_tokens"),
            "version_seq_tokens_mean": mean("recovery/bench_version_seq_tokens"),
            "weights_nbytes": weights_nbytes, "n_steps": len(records)}


def fits(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy: recovery seconds vs total parameters at each eta, and vs distinct versions per batch
    for each model (power laws; None where a fit has fewer than two distinct x)."""
    out: dict[str, dict[str, Any]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        vs_params = {}
        for eta in sorted({r["eta"] for r in mine}):
            pts = [r for r in mine if r["eta"] == eta]
            vs_params[str(eta)] = power_law([r["params"] for r in pts], [r["recovery_s_median"] for r in pts])
        vs_versions = {}
        for model in dict.fromkeys(r["model"] for r in mine):
            pts = [r for r in mine if r["model"] == model]
            vs_versions[model] = power_law([r["distinct_versions_mean"] for r in pts],
                                           [r["recovery_s_median"] for r in pts])
        out[strategy] = {"recovery_vs_params": vs_params, "recovery_vs_versions": vs_versions}
    return out


def growth(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy: which costs grow with eta (module doc), with each cost's ratio per model."""
    out: dict[str, dict[str, Any]] = {}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        per_cost: dict[str, Any] = {}
        for cost, floor in GROWTH_FLOOR.items():
            ratios, grows = {}, []
            for model in dict.fromkeys(r["model"] for r in rows if r["strategy"] == strategy):
                pts = sorted((r for r in rows if r["strategy"] == strategy and r["model"] == model),
                             key=lambda r: r["eta"])
                if len(pts) < 2:
                    continue
                lo, hi = pts[0][cost] or 0.0, pts[-1][cost] or 0.0
                unit = pts[0]["weights_nbytes"] if cost == "extra_bytes_held" else 1.0
                ratios[model] = hi / lo if lo > 0 else (None if hi == 0 else float("inf"))
                grows.append(hi >= GROWTH_RATIO * lo and hi - lo > floor * unit)
            per_cost[cost] = {"ratio_by_model": {k: (v if v is None or v != float("inf") else "inf")
                                                 for k, v in ratios.items()},
                              "grows": bool(grows) and sum(grows) * 2 >= len(grows)}
        out[strategy] = {**per_cost, "grows_with_eta": any(c["grows"] for c in per_cost.values())}
    return out


def build_sweep_report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    return {"sweep": {"rows": rows, "fits": fits(rows), "growth": growth(rows)}, "meta": meta}


def _fmt_fit(f: dict | None) -> str:
    return "n/a" if f is None else f"{f['exponent']:.2f} (r2 {f['r2']:.2f})"


def render_sweep_markdown(rep: dict[str, Any]) -> str:
    sw, meta = rep["sweep"], rep["meta"]
    rows = sw["rows"]
    out = ["# megarl bench --sweep", "",
           f"Config `{meta.get('config', '?')}`, {meta.get('steps', '?')} steps per run, one run per cell, "
           f"{meta.get('cpu_count', '?')} CPUs (load average {meta.get('loadavg_start', 0):.2f} at the start, "
           f"{meta.get('loadavg_end', 0):.2f} at the end).", "",
           "## Costs per cell (medians over steps 2..N)", "",
           "| model | params | eta | strategy | step s | recovery s | extra MB held | MB moved / step | "
           "stall / publish ms | versions / batch |", "|" + "---|" * 10]
    for r in rows:
        stall = "n/a" if r["stall_per_publish_s"] is None else f"{1e3 * r['stall_per_publish_s']:.1f}"
        out.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['eta']} | {r['strategy']} | "
                   f"{r['step_time_s_median']:.4f} | {r['recovery_s_median']:.4f} | "
                   f"{r['extra_bytes_held'] / 1e6:.2f} | "
                   f"{r['bytes_moved_per_step'] / 1e6:.2f} | {stall} | {r['distinct_versions_mean']:.2f} |")
    out += ["", "## Which costs grow with eta", "",
            f"A cost grows with eta when it rises at least {GROWTH_RATIO:g}x from the smallest to the largest eta "
            f"and by more than its noise floor (recovery {GROWTH_FLOOR['recovery_s_median'] * 1e3:g} ms, bytes held "
            f"{GROWTH_FLOOR['extra_bytes_held']:g} sets of weights, stall {GROWTH_FLOOR['stall_per_publish_s'] * 1e3:g}"
            f" ms), on at least half of the models.", "",
            "| strategy | grows with eta | recovery s | extra bytes held | stall per publish |",
            "|---|---|---|---|---|"]
    for name, g in sw["growth"].items():
        cols = []
        for cost in GROWTH_FLOOR:
            ratios = ", ".join(f"{m} {'n/a' if v is None else v if isinstance(v, str) else f'{v:.2f}x'}"
                               for m, v in g[cost]["ratio_by_model"].items())
            cols.append(f"{'grows' if g[cost]['grows'] else 'flat'} ({ratios})")
        out.append(f"| {name} | {'yes' if g['grows_with_eta'] else 'no'} | " + " | ".join(cols) + " |")
    growing = [n for n, g in sw["growth"].items() if g["grows_with_eta"]]
    flat = [n for n, g in sw["growth"].items() if not g["grows_with_eta"]]
    out += ["", f"Costs that grow with eta: {', '.join(growing) or 'none'}. Flat: {', '.join(flat) or 'none'}."]
    out += ["", "## Fitted growth of recovery seconds (power-law exponent b of y = c x^b)", "",
            "| strategy | vs parameters, per eta | vs distinct versions per batch, per model |", "|---|---|---|"]
    for name, f in sw["fits"].items():
        p = ", ".join(f"eta {e}: {_fmt_fit(v)}" for e, v in f["recovery_vs_params"].items())
        v = ", ".join(f"{m}: {_fmt_fit(x)}" for m, x in f["recovery_vs_versions"].items())
        out.append(f"| {name} | {p} | {v} |")
    out += ["", "## Publish stall per publish against model size (median ms)", ""]
    out += report_render.stall_table({f"{r['model']} eta{r['eta']} {r['strategy']}": r["stall_parts_s"] for r in rows})
    out += ["", "`scaling.png`: recovery seconds against parameters and against distinct versions per batch, "
            "publish stall against parameters, extra bytes held against eta.", ""]
    return "\n".join(out)


def run_sweep(config: str, models: list[str], etas: list[int], strategies: list[str], steps: int, output: str,
              overrides: list[str], *, run: Callable[[dict], dict], meta: dict[str, Any],
              log=print) -> dict[str, Any]:
    """Every cell in turn (``run(spec) -> {"records", "weights_nbytes", ...}``, megarl.bench.run.run_strategy),
    then report.json, report.md and scaling.png under ``output``."""
    from megarl.bench import plots  # lazy: matplotlib

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    infos = [model_info(resolve_model(m)) for m in models]
    grid = cells(infos, etas, strategies)
    rows = []
    for i, (m, eta, strategy) in enumerate(grid, 1):
        log(f"[{i}/{len(grid)}] {m['model']} eta={eta} {strategy} ...")
        name = f"{m['model']}_eta{eta}_{strategy}"
        res = run({"config": config, "strategy": strategy, "steps": steps, "run_dir": str(out / "runs" / name),
                   "verify": False, "overrides": [*overrides, f"model.init_model={m['yaml']}",
                                                  f"model.checkpoint={out / 'checkpoints' / m['model']}",
                                                  f"rollout.eta={eta}"]})
        rows.append({**{k: m[k] for k in ("model", "params", "active_params", "moe")}, "eta": eta,
                     "strategy": strategy, **sweep_row(res["records"], res["weights_nbytes"])})
    rep = build_sweep_report(rows, meta)
    plots.scaling_plot(rep, out / "scaling.png")
    return rep
