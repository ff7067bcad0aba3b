"""Aggregate per-step metrics records (metrics.jsonl) into the bench report.

Per step, with the bench wrapper's keys (megarl.bench.run; 0 when absent, so
any metrics.jsonl works) ``va = recovery/bench_verifier_anchor_s`` and
``vp = recovery/bench_verifier_publish_s``::

    recovery        = recovery_s - va                   # the strategy's anchor(), dedicated waits included
    step            = step_s - va - vp
    hooks           = recovery/bench_hook_publish_s + recovery/bench_hook_optimizer_s
    critical        = recovery + publish_recovery_s + hooks
    wall            = wall_s - (va + vp summed up to this step)
    gen_stall_total = gen_stall_total_s - (vp summed up to this step)

Per strategy, over the steady state = steps 2..N (the first step also holds
start-up: the first batch's generation, the dedicated scorer's model build):

- ``step_time_s_median``, ``recovery_s_median``: medians over steps 2..N.
- ``critical_path_overhead_frac`` = sum(critical) / sum(step) over steps 2..N:
  the share of the trainer loop spent in recovery work it waits for.
  Dedicated's waits for its scorer (``recovery/dedicated_wait_s``) happen
  inside anchor(), so they are already in ``recovery``, not added twice.
- ``gen_stall_frac`` = (gen_stall_total[N] - gen_stall_total[1]) /
  (wall[N] - wall[1]): the share of time the engines were stopped for
  publishing (drain, recovery, weight load, hooks); step N does not publish.
- ``peak_rss_mb``: peak resident memory of the run's process tree (run.py).
- ``extra_param_copies``: max over steps of ``recovery/extra_param_copies``.
- ``bytes_moved`` = sum of ``recovery/bytes_moved`` + publishes x bytes of one
  HF checkpoint (the weights each publish writes for the engines).
- ``max_abs_err_vs_exact``: max over steps of ``verify/max_abs_err`` (null if
  not verified or not finite).

``throughput_ratio`` = tokens/s of the async run / tokens/s of the sync run,
each = policy tokens trained in steps 2..N / (wall at step N - wall at step 1);
``throughput_ratio_disjoint_cores`` the same with the trainer and the engines
on disjoint cores (``placement.cpu_affinity``; megarl/bench/compare_sync.py).

Publish stall per publish (:func:`publish_stall`), medians over the steps
that published, verifier time removed: ``drain`` (abort, wait for every
request to return), ``recovery`` (the strategy's ``before_publish``), the
engines' own phases (``engine_abort`` ... ``engine_resume``, the slowest
engine's), ``sync_other`` (weight sync time outside the engines' phases:
HTTP, the broadcast wire), ``hooks`` (``on_weights_published``) and
``stall`` (all of it).

The dedicated scorer on fewer than 3 cores has no core of its own: its
critical-path share would measure core contention, so it is not reported
(``null``); its lag is (``scorer_pending_segments_median``: segments sent and
not scored at a step; ``scorer_lag_s_median`` / ``_max``: age of the oldest).

megarl/bench/report_render.py renders the report as report.md and as the table on stdout.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

#: the stacked phases of overhead.png, in order; each a per-step key of step_phases()
PHASES = ("wait_batch", "recovery", "train_step", "publish_drain", "publish_recovery", "weight_sync",
          "recovery_hooks", "other")
#: the engines' phases of a weight update (megarl.rollout.base.UPDATE_PHASES) as step-record keys
ENGINE_STALL = ("engine_abort", "engine_pause", "engine_reload", "engine_cache_reset", "engine_resume")
#: the parts of one publish stall, in order (publish_stall)
STALL_PARTS = ("drain", "recovery", *ENGINE_STALL, "sync_other", "hooks")
#: fewer cores than this: the dedicated scorer cannot have one of its own
SCORER_OWN_CORE_MIN_CPUS = 3


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _num(rec: dict, key: str) -> float:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def step_phases(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step: the phases, ``step``, ``critical``, ``wall`` and ``gen_stall_total``, verifier time removed."""
    out = []
    verifier_total = stall_verifier_total = 0.0
    for r in records:
        va, vp = _num(r, "recovery/bench_verifier_anchor_s"), _num(r, "recovery/bench_verifier_publish_s")
        verifier_total += va + vp
        stall_verifier_total += vp
        p = {"wait_batch": _num(r, "wait_batch_s"), "recovery": _num(r, "recovery_s") - va,
             "train_step": _num(r, "train_step_s"), "publish_drain": _num(r, "publish_drain_s"),
             "publish_recovery": _num(r, "publish_recovery_s"), "weight_sync": _num(r, "weight_sync_s"),
             "recovery_hooks": _num(r, "recovery/bench_hook_publish_s") + _num(r, "recovery/bench_hook_optimizer_s")}
        step = _num(r, "step_s") - va - vp
        p["other"] = step - sum(p.values())
        p["step"] = step
        p["critical"] = p["recovery"] + p["publish_recovery"] + p["recovery_hooks"]
        p["wall"] = _num(r, "wall_s") - verifier_total
        p["gen_stall_total"] = _num(r, "gen_stall_total_s") - stall_verifier_total
        out.append(p)
    return out


def _max_key(records: list[dict], key: str) -> float:
    vals = [r[key] for r in records if key in r]
    if not vals:
        return 0.0
    return math.inf if any(v is None for v in vals) else float(max(vals))  # None: logged non-finite


def summarize(records: list[dict[str, Any]], weights_nbytes: int, peak_rss_mb: float,
              verified: bool = True) -> dict[str, Any]:
    """The report.json entry of one strategy (module docstring)."""
    if not records:
        raise ValueError("no metrics records (the run logged no step)")
    ph = step_phases(records)
    steady = _steady(ph)
    step_sum = sum(p["step"] for p in steady)
    first, last = (ph[0], ph[-1]) if len(ph) > 1 else ({"wall": 0.0, "gen_stall_total": 0.0}, ph[-1])
    span = last["wall"] - first["wall"]
    n_publish = sum(1 for r in records if "publish_s" in r)
    err = _max_key(records, "verify/max_abs_err") if verified else math.nan
    return {
        "step_time_s_median": statistics.median(p["step"] for p in steady),
        "recovery_s_median": statistics.median(p["recovery"] for p in steady),
        "critical_path_overhead_frac": sum(p["critical"] for p in steady) / step_sum if step_sum > 0 else 0.0,
        "gen_stall_frac": (last["gen_stall_total"] - first["gen_stall_total"]) / span if span > 0 else 0.0,
        "peak_rss_mb": float(peak_rss_mb),
        "extra_param_copies": _max_key(records, "recovery/extra_param_copies"),
        "bytes_moved": int(round(sum(_num(r, "recovery/bytes_moved") for r in records) + n_publish * weights_nbytes)),
        "max_abs_err_vs_exact": err if math.isfinite(err) else None,
    }


def publish_stall(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median seconds per publish of each of :data:`STALL_PARTS` and of the whole ``stall`` (module doc);
    None when the run never published."""
    rows = []
    for r in records:
        if "publish_stall_s" not in r:
            continue
        engine = {k: _num(r, f"{k}_s") for k in ENGINE_STALL}
        row = {"drain": _num(r, "publish_drain_s"), "recovery": _num(r, "publish_recovery_s"), **engine,
               "sync_other": _num(r, "weight_sync_s") - sum(engine.values()),
               "hooks": _num(r, "recovery/bench_hook_publish_s"),
               "stall": _num(r, "publish_stall_s") - _num(r, "recovery/bench_verifier_publish_s")}
        rows.append(row)
    if not rows:
        return None
    return {k: statistics.median(row[k] for row in rows) for k in (*STALL_PARTS, "stall")}


def scorer_lag(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """The dedicated scorer's lag over steps 2..N (module doc); None when the run has no scorer."""
    steady = records[1:] or records
    if not any("recovery/lag_s" in r for r in steady):
        return None
    lags = [_num(r, "recovery/lag_s") for r in steady]
    return {"scorer_pending_segments_median": statistics.median(_num(r, "recovery/pending_segments") for r in steady),
            "scorer_lag_s_median": statistics.median(lags), "scorer_lag_s_max": max(lags)}


def _steady(ph: list[dict[str, float]]) -> list[dict[str, float]]:
    """Steps 2..N (all of them when there is only one)."""
    return ph[1:] or ph


def phase_medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per step (steps 2..N) of each phase, and of the whole step (``step``)."""
    ph = _steady(step_phases(records))
    return {k: statistics.median(p[k] for p in ph) for k in (*PHASES, "step")}


def tokens_per_s(records: list[dict[str, Any]]) -> float:
    """Policy tokens trained per second after the first step (engine and trainer start-up excluded)."""
    if len(records) < 2:
        raise ValueError("throughput needs at least 2 steps")
    ph = step_phases(records)
    seconds = ph[-1]["wall"] - ph[0]["wall"]
    return sum(_num(r, "tokens") for r in records[1:]) / seconds if seconds > 0 else math.nan


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or not b.get(key):
        return None
    return a[key] / b[key]


def throughput(sync_runs: dict[str, list[dict]] | None) -> dict[str, Any]:
    """``async_vs_sync`` of the report from the runs of --compare-sync (keys async, sync, and optionally
    async_disjoint, sync_disjoint: megarl/bench/compare_sync.py); ratios None when not measured."""
    out: dict[str, Any] = {"throughput_ratio": None, "throughput_ratio_disjoint_cores": None}
    for suffix, key in (("", "throughput_ratio"), ("_disjoint", "throughput_ratio_disjoint_cores")):
        if sync_runs is None or f"async{suffix}" not in sync_runs:
            continue
        a, s = tokens_per_s(sync_runs[f"async{suffix}"]), tokens_per_s(sync_runs[f"sync{suffix}"])
        out.update({key: _finite(a / s) if s > 0 else None, f"tokens_per_s_async{suffix}": _finite(a),
                    f"tokens_per_s_sync{suffix}": _finite(s)})
    return out


def targets(strategies: dict[str, dict], async_vs_sync: dict) -> list[dict[str, Any]]:
    """The design targets with their measured values; ``passed`` is None when not measured."""
    s = strategies.get
    rows = [
        ("ewma step time / recompute step time", _ratio(s("ewma"), s("recompute"), "step_time_s_median"), "<=", 1.05),
        ("snapshot step time / ewma step time", _ratio(s("snapshot"), s("ewma"), "step_time_s_median"), "<=", 1.5),
        ("dedicated: recovery share of the trainer critical path",
         s("dedicated", {}).get("critical_path_overhead_frac"), "<=", 0.05),
        ("interrupt_sync: engine stall share of wall time", s("interrupt_sync", {}).get("gen_stall_frac"), "<=", 0.10),
        ("async / sync throughput (tokens/s)", async_vs_sync.get("throughput_ratio"), ">=", 2.0),
        ("async / sync throughput on disjoint cores (tokens/s)",
         async_vs_sync.get("throughput_ratio_disjoint_cores"), ">=", 2.0),
    ]
    out = []
    for name, value, op, bound in rows:
        ok = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out.append({"target": name, "value": value, "op": op, "bound": bound, "passed": ok})
    return out


def build_report(runs: dict[str, dict[str, Any]], sync_runs: dict[str, list[dict]] | None,
                 meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``runs[name] = {"records", "child": {"peak_rss_mb", ...}, "weights_nbytes"}``;
    ``sync_runs`` = {"async", "sync"} records."""
    verified = bool((meta or {}).get("verify", True))
    strategies = {n: summarize(r["records"], r["weights_nbytes"], r["child"]["peak_rss_mb"], verified)
                  for n, r in runs.items()}
    scorer_has_core = int((meta or {}).get("cpu_count") or SCORER_OWN_CORE_MIN_CPUS) >= SCORER_OWN_CORE_MIN_CPUS
    for n, r in runs.items():
        lag = scorer_lag(r["records"])
        if lag is not None:
            strategies[n].update(lag)
            if not scorer_has_core:  # it shares the trainer's and the engines' cores: the share measures that
                strategies[n]["critical_path_overhead_frac"] = None
    async_vs_sync = throughput(sync_runs)
    return {"strategies": strategies, "async_vs_sync": async_vs_sync,
            "phases_s_median": {n: phase_medians(r["records"]) for n, r in runs.items()},
            "publish_stall_s_median": {n: publish_stall(r["records"]) for n, r in runs.items()},
            "targets": targets(strategies, async_vs_sync), "meta": meta or {}}
