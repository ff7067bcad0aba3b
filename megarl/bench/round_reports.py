"""One `megarl bench` report from the report of each interleaved round (megarl/bench/interleave.py makes the
rounds and the intervals; megarl/bench/report.py builds each round's report and judges the targets)."""
from __future__ import annotations

import statistics
from typing import Any

from megarl.bench import report
from megarl.bench.interleave import THROUGHPUT_TARGETS, combine, holds, ratio_interval, ratio_pairs


def _median_tables(tables: list[dict[str, dict[str, float] | None]]) -> dict[str, dict[str, float] | None]:
    out = {}
    for name, first in tables[0].items():
        rows = [t.get(name) for t in tables]
        out[name] = None if first is None or any(r is None for r in rows) else \
            {k: statistics.median(r[k] for r in rows) for k in first}
    return out


def _throughput(rounds: list[dict[str, Any]], intervals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``async_vs_sync`` over the rounds: each ratio the geometric mean of the per-round ratios, with its interval
    under ``KEY_interval`` (also put in ``intervals`` under its target's name), tokens per second the median."""
    out = dict(rounds[0])
    for suffix, key, target in THROUGHPUT_TARGETS:
        if rounds[0].get(key) is None:
            continue
        a, b = ([x.get(f"tokens_per_s_{kind}{suffix}") for x in rounds] for kind in ("async", "sync"))
        r = ratio_interval(a, b)
        for kind, values in (("async", a), ("sync", b)):
            out[f"tokens_per_s_{kind}{suffix}"] = combine(values, key)
        out[key] = None if r is None else r["ratio"]
        out[f"{key}_interval"] = r
        if r is not None:
            intervals[target] = r
    return out


def combine_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One bench report from the report of each round (megarl/bench/report.py ``build_report``; the first
    holds the --compare-sync runs): per strategy the median over the rounds (the largest for
    ``interleave.MAX_FIELDS``), phase and stall tables the median of the rounds' medians, ``ratios`` with their
    intervals, and the step-time targets judged on them."""


    first = reports[0]
    strategies = {name: {k: combine([r["strategies"][name][k] for r in reports], k) for k in s}
                  for name, s in first["strategies"].items()}
    names = list(strategies)
    ratios = []
    for a, b in ratio_pairs(names):
        r = ratio_interval([x["strategies"][a]["step_time_s_median"] for x in reports],
                           [x["strategies"][b]["step_time_s_median"] for x in reports])
        if r is not None:
            ratios.append({"of": a, "to": b, "key": "step_time_s_median", **r})
    intervals = {f"{r['of']} step time / {r['to']} step time": r for r in ratios}
    avs = _throughput([r["async_vs_sync"] for r in reports], intervals)
    targets = report.targets(strategies, avs)
    for t in targets:
        r = intervals.get(t["target"])
        if r is not None:
            ok = r["ratio"] <= t["bound"] if t["op"] == "<=" else r["ratio"] >= t["bound"]
            t.update(value=r["ratio"], passed=ok, low=r["low"], high=r["high"], level=r["level"], n=r["n"],
                     resolved=not holds(r, t["bound"]))
    return {**first, "strategies": strategies, "ratios": ratios, "targets": targets, "async_vs_sync": avs,
            "phases_s_median": _median_tables([r["phases_s_median"] for r in reports]),
            "publish_stall_s_median": _median_tables([r["publish_stall_s_median"] for r in reports])}
