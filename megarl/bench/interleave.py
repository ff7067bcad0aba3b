"""Timings that survive a busy machine: the strategies' runs interleaved and repeated, each ratio with an interval.

A strategy's timing run is a fresh process with its own training loop (megarl/bench/run.py), so two
strategies cannot take turns step by step inside one process; their runs take turns instead.
:func:`schedule` makes ``repeats`` rounds, each running every strategy once, the order reversed every
other round (A B C, C B A, A B C, ...). Load that arrives or leaves between two runs then falls on
every strategy in turn instead of on the strategies that happened to run last, and load that changes
between rounds changes all the runs of a round, which a per-round ratio cancels.

Per round, a strategy's number is the median over its run's steps 2..N (step 1 holds start-up). A
ratio of two strategies is taken per round (``a_r / b_r``, both runs from round r), and its interval
is a Student t interval at :data:`LEVEL` on the logs of the per-round ratios, mapped back:
exp(mean +- t_{(1+level)/2, n-1} sd / sqrt(n)) over the n rounds (Student, 1908). Its centre is the
geometric mean of the ratios (on a log scale a ratio of 2 and one of 1/2 weigh alike). A share (a
strategy's own seconds over its step) gets the same t interval on the per-round shares, unlogged. With
one round there is no interval (``low`` and ``high`` are None). A percentile bootstrap is not used: on
3-5 values its resamples understate the spread (megarl/bench/quality_stats.py).

A round whose runs straddle a change of load gives one ratio off the others; the interval widens by
it instead of moving the estimate the way one loaded sequential run does
(tests/unit/test_bench_interleave.py injects such a burst).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

LEVEL = 0.9
"""Two-sided level of every interval over the repeats."""
DEFAULT_REPEATS = 3
"""Rounds of `megarl bench` and `megarl advise` unless --repeats says otherwise."""
METHOD = "90% t interval over the repeats on the log of the per-repeat ratios"
#: per-run fields taken as the largest over the repeats (the others: the median)
MAX_FIELDS = ("peak_rss_mb", "extra_param_copies", "max_abs_err_vs_exact", "scorer_lag_s_max", "run_s")


def schedule(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(round, name)`` in run order: every name once per round, every other round reversed (module doc)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: give at least 1")
    return [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else names[::-1])]


def sync_schedule(planned: list[tuple[str, str, list[str]]], repeats: int) -> list[tuple[int, tuple]]:
    """``(round, run)`` of --compare-sync's runs (megarl/bench/compare_sync.py ``sync_runs``): the async and
    sync runs on shared cores alternate over the rounds (A S, S A, ...), then those on disjoint cores do
    (their engines are started once per core layout, not once per run)."""
    pairs = [planned[i:i + 2] for i in range(0, len(planned), 2)]
    return [(r, run) for pair in pairs for r, key in schedule([p[0] for p in pair], repeats)
            for run in pair if run[0] == key]


def describe(repeats: int) -> str:
    """The schedule in words, for the reports."""
    if repeats == 1:
        return "one run each, one after another (no repeats: no intervals)"
    return (f"{repeats} runs each, interleaved: every strategy once per round, the order reversed every other "
            f"round; ratios with a {METHOD}")


def t_interval(values: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean of ``values`` and its Student t interval at ``level`` (``low``/``high`` None with fewer than 2), with
    the quantile ``t`` and standard error ``se`` it took."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n, "level": level}
    from scipy.stats import t as student_t  # scipy: when an interval is computed, not for `megarl --help`

    t, se = float(student_t.ppf((1.0 + level) / 2.0, n - 1)), statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "low": mean - t * se, "high": mean + t * se, "n": n, "level": level, "t": t, "se": se}


def ratio_interval(num: list[float], den: list[float], level: float = LEVEL) -> dict[str, Any] | None:
    """Per-round ratios ``num[r] / den[r]``, their geometric mean and t interval on the log (module doc);
    None when a value is missing or not positive."""
    if len(num) != len(den):
        raise ValueError(f"a ratio per round needs as many numerators as denominators ({len(num)} vs {len(den)})")
    if not num or any(x is None or not x > 0 for x in (*num, *den)):
        return None
    per = [a / b for a, b in zip(num, den)]
    t = t_interval([math.log(x) for x in per], level)
    low, high = (None, None) if t["low"] is None else (math.exp(t["low"]), math.exp(t["high"]))
    return {"ratio": math.exp(t["mean"]), "low": low, "high": high, "level": level,
            "n": t["n"], "per_repeat": per, "method": METHOD}


def share_interval(parts: list[float], wholes: list[float], level: float = LEVEL) -> dict[str, Any] | None:
    """Per-round shares ``parts[r] / wholes[r]``, their mean and t interval; None without a positive whole."""
    if not parts or any(w is None or not w > 0 for w in wholes) or any(p is None for p in parts):
        return None
    per = [p / w for p, w in zip(parts, wholes)]
    t = t_interval(per, level)
    return {"share": t["mean"], "low": t["low"], "high": t["high"], "level": level, "n": t["n"],
            "per_repeat": per, "method": "90% t interval over the repeats on the per-repeat shares"}


def holds(interval: dict[str, Any] | None, value: float) -> bool:
    """Whether ``value`` lies inside the interval (False without one)."""
    return bool(interval) and interval["low"] is not None and interval["low"] <= value <= interval["high"]


def ratio_text(r: dict[str, Any]) -> str:
    """``1.180 [1.020, 1.370]``, or ``1.180 (one repeat: no interval)``."""
    if r["low"] is None:
        return f"{r['ratio']:.3f} (one repeat: no interval)"
    return f"{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"


# -- the bench report over repeats ----------------------------------------------------------
def combine(values: list[Any], key: str) -> Any:
    """The value over the repeats: None if one is None, the largest for :data:`MAX_FIELDS`, else the median."""
    if any(v is None for v in values):
        return None
    out = max(values) if key in MAX_FIELDS else statistics.median(values)
    return int(round(out)) if all(isinstance(v, int) for v in values) else out


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Each strategy against the baseline (behav when it ran, else the first), then the targets' pairs."""
    if len(names) < 2:
        return []
    base = "behav" if "behav" in names else names[0]
    pairs = [(n, base) for n in names if n != base]
    return pairs + [p for p in (("ewma", "recompute"), ("snapshot", "ewma")) if set(p) <= set(names)
                    and p not in pairs]


#: the report's throughput ratios and the names of their targets (megarl/bench/report.py ``targets``)
THROUGHPUT_TARGETS = (("", "throughput_ratio", "async / sync throughput (tokens/s)"),
                      ("_disjoint", "throughput_ratio_disjoint_cores",
                       "async / sync throughput on disjoint cores (tokens/s)"))


def throughput_text(avs: dict[str, Any], key: str) -> str:
    """``2.31``, or ``2.31 [1.90, 2.80] over 3 repeats`` with an interval; ``not measured`` without the ratio."""
    if avs.get(key) is None:
        return "not measured"
    r = avs.get(f"{key}_interval")
    return f"{avs[key]:.2f}" + ("" if not r or r["low"] is None else
                                f" [{r['low']:.2f}, {r['high']:.2f}] over {r['n']} repeats")


def target_cells(t: dict[str, Any]) -> tuple[str, str]:
    """A target line's status and value: PASS / FAIL / SKIP, or OPEN when its interval holds the bound."""
    status = {True: "PASS", False: "FAIL", None: "SKIP"}[t["passed"]]
    if t["value"] is None:
        return status, "not measured"
    if t.get("low") is None:
        return status, f"{t['value']:.3f}"
    value = f"{t['value']:.3f} [{t['low']:.3f}, {t['high']:.3f}] over {t['n']} repeats"
    return (status, value) if t["resolved"] else ("OPEN", value + ", the interval holds the bound")


def ratio_lines(rep: dict[str, Any]) -> list[str]:
    """The report's step-time ratios, one line each, and how they were measured."""
    ratios = rep.get("ratios") or []
    if not ratios:
        return []
    meta = rep.get("meta", {})
    lines = [f"Step time ratios (median step over steps 2..N per run; {meta.get('runs', describe(1))}):", ""]
    for r in ratios:
        per = ", ".join(f"{x:.3f}" for x in r["per_repeat"])
        lines.append(f"- {r['of']} / {r['to']}: {ratio_text(r)} (per repeat: {per})")
    return lines
