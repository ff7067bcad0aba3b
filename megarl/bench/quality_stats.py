"""The numbers `megarl bench --quality` reports per cell (strategy variant x eta, over its seeds).

Steps to a reward threshold (:func:`steps_to_threshold`): per seed, the first
optimizer step (1-based) at which the smoothed batch reward (the curves' trailing
moving average) is at least the threshold, ``None`` when it never gets there.
Over the seeds (:func:`threshold_summary`): how many reached it, the median with
"not reached" counted as later than any step (``None`` when the median seed did
not reach it) and the mean over the seeds that reached it.

Difference to behav (:func:`diff_interval`): a cell's final-window reward minus
behav's at the same eta, with a t interval at ``level`` (default 0.9). Seeds are
``trainer.seed`` values, and a seed sets the data order and sampling seeds of every
cell alike, so two cells that ran the same set of seeds are compared **paired by
seed**: the per-seed differences d_i, their mean and a Student t interval mean(d) +-
t_{(1+level)/2, n-1} sd(d) / sqrt(n) over the n pairs (Student, 1908; the seed's own
luck cancels in d_i). Cells with different seed sets are compared with **Welch's** t
interval (Welch, 1947): mean(a) - mean(b) +- t_{(1+level)/2, v} sqrt(s_a^2/n_a +
s_b^2/n_b), v the Welch-Satterthwaite degrees of freedom. Both assume roughly normal
per-seed rewards; then the paired interval holds its level exactly at any n >= 2 and
Welch's closely. A percentile bootstrap over 3 seeds per cell does not: resamples of
3 values understate the spread, and its nominal 90% interval covered a true zero
difference about 74% of the time. The verdict says only what the interval says: "no
difference detectable at this n" when it holds 0, else "above behav" / "below
behav". It needs at least two seeds on each side (two pairs when paired); with fewer
it is ``None``. The t quantiles are scipy's (``scipy.stats.t.ppf``).

What a grid calls a difference (:func:`call_differences`, docs/results.md's rule):
nothing below ``MIN_SEEDS_TO_CALL`` seeds on either side ("not called at n < 5":
the interval is still shown), and over the grid's comparisons a difference is
called only when it survives Holm's step-down correction (Holm, 1979) at
alpha = 1 - level: the comparisons' two-sided t p-values, ascending, p_(k) <=
alpha / (m - k + 1) until the first that fails. An interval that excludes 0 on
its own but not after the correction says "no difference called after Holm".

Logged diagnostics (:func:`cell_diagnostics`), each pooled over every step of
every seed that logged it (``None`` when none did): the mean of
``r_d/abs_logp_mean`` (|logp_old - logp_behav|; logged only where logp_old is
known, i.e. by exact strategies), of the loss's
``abs_logp_anchor_minus_behav_mean`` (|logp_anchor - logp_behav|, every strategy)
and of ``behav_w/masked_frac`` / ``behav_w/downweighted_frac``; the per-step mean
over the seeds of the loss's ``active_frac`` (share of policy tokens the loss keeps)
and its minimum, and the lowest ``ewma/active_frac_pre`` (ewma's active share
before a reset).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from scipy.stats import t as student_t

from megarl.bench.interleave import t_interval

DIFF_LEVEL = 0.9
NO_DIFFERENCE = "no difference detectable at this n"
TOO_FEW = "n too small"
MIN_SEEDS_TO_CALL = 5
"""Fewest seeds on each side (pairs when paired) at which a grid's report calls a difference."""
NOT_CALLED = f"not called at n < {MIN_SEEDS_TO_CALL}"
NOT_AFTER_HOLM = "no difference called after Holm"


def steps_to_threshold(smoothed: list[float], threshold: float) -> int | None:
    """First step (1-based) whose smoothed reward is >= ``threshold``; None when none is."""
    return next((i + 1 for i, x in enumerate(smoothed) if x >= threshold), None)


def threshold_summary(per_seed: list[int | None]) -> dict[str, Any]:
    reached = [s for s in per_seed if s is not None]
    median = statistics.median([math.inf if s is None else float(s) for s in per_seed]) if per_seed else math.inf
    return {"per_seed": per_seed, "reached": len(reached), "of": len(per_seed),
            "median": None if math.isinf(median) else median,
            "mean": statistics.fmean(reached) if reached else None}


def _verdict(low: float, high: float, reference: str) -> str:
    if low <= 0.0 <= high:
        return NO_DIFFERENCE
    return f"above {reference}" if low > 0.0 else f"below {reference}"


def paired_t_interval(a: list[float], b: list[float], *, level: float = DIFF_LEVEL,
                      reference: str = "behav") -> dict[str, Any] | None:
    """mean(a_i - b_i) and its paired t interval (module doc), ``a[i]`` and ``b[i]`` from the same seed; None
    with fewer than 2 pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired values need as many of a as of b (got {len(a)} and {len(b)})")
    n = len(a)
    if n < 2:
        return None
    iv = t_interval([x - y for x, y in zip(a, b)], level)
    return {"diff": iv["mean"], "low": iv["low"], "high": iv["high"], "level": level, "method": "paired t", "n": n,
            "n_a": n, "n_b": n, "df": float(n - 1), "t": iv["t"], "se": iv["se"],
            "verdict": _verdict(iv["low"], iv["high"], reference)}


def welch_t_interval(a: list[float], b: list[float], *, level: float = DIFF_LEVEL,
                     reference: str = "behav") -> dict[str, Any] | None:
    """mean(a) - mean(b) and Welch's t interval (module doc); None with fewer than 2 values on a side."""
    n_a, n_b = len(a), len(b)
    if n_a < 2 or n_b < 2:
        return None
    va, vb = statistics.variance(a) / n_a, statistics.variance(b) / n_b  # squared standard errors of the means
    se = math.sqrt(va + vb)
    if se > 0.0:
        df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    else:  # both cells constant: Welch-Satterthwaite is 0/0, and any df gives the same zero-width interval
        df = float(n_a + n_b - 2)
    mean = statistics.fmean(a) - statistics.fmean(b)
    t = float(student_t.ppf((1.0 + level) / 2.0, df))
    low, high = mean - t * se, mean + t * se
    return {"diff": mean, "low": low, "high": high, "level": level, "method": "Welch t", "n": None, "n_a": n_a,
            "n_b": n_b, "df": df, "t": t, "se": se, "verdict": _verdict(low, high, reference)}


def diff_interval(a: dict[int, float], b: dict[int, float], *, level: float = DIFF_LEVEL,
                  reference: str = "behav") -> dict[str, Any] | None:
    """A cell's values minus the reference cell's, each keyed by seed: paired by seed when both hold the same
    seeds, Welch otherwise (module doc); None with fewer than 2 seeds on a side."""
    if set(a) == set(b):
        seeds = sorted(a)
        return paired_t_interval([a[s] for s in seeds], [b[s] for s in seeds], level=level, reference=reference)
    return welch_t_interval(list(a.values()), list(b.values()), level=level, reference=reference)


def p_value(iv: dict[str, Any]) -> float:
    """Two-sided p-value of a t interval's difference against 0 (its t statistic at its df)."""
    if iv["se"] == 0.0:
        return 1.0 if iv["diff"] == 0.0 else 0.0
    return float(2.0 * student_t.sf(abs(iv["diff"]) / iv["se"], iv["df"]))


def holm(p_values: list[float], alpha: float) -> list[bool]:
    """Holm's step-down rejections (module doc) of the family ``p_values``, in their order."""
    m, out = len(p_values), [False] * len(p_values)
    for k, i in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        if p_values[i] > alpha / (m - k):
            break
        out[i] = True
    return out


def call_differences(intervals: list[dict[str, Any] | None], level: float = DIFF_LEVEL) -> list[str]:
    """The verdict of each of a grid's comparisons (module doc): ``TOO_FEW`` without an interval,
    ``NOT_CALLED`` below ``MIN_SEEDS_TO_CALL`` seeds a side, else the interval's verdict where it survives
    Holm's correction over every comparison that has an interval."""
    family = [i for i, iv in enumerate(intervals) if iv is not None]
    called = dict(zip(family, holm([p_value(intervals[i]) for i in family], 1.0 - level)))
    out = []
    for i, iv in enumerate(intervals):
        if iv is None:
            out.append(TOO_FEW)
        elif min(iv["n_a"], iv["n_b"]) < MIN_SEEDS_TO_CALL:
            out.append(NOT_CALLED)
        elif iv["verdict"] != NO_DIFFERENCE and not called[i]:
            out.append(NOT_AFTER_HOLM)
        else:
            out.append(iv["verdict"])
    return out


def logged_values(records: list[dict[str, Any]], key: str) -> list[float]:
    """The numeric values of ``key`` in ``records``, skipping records that lack it (or hold null)."""
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]


def pooled_mean(runs: list[list[dict[str, Any]]], key: str) -> float | None:
    """Mean of ``key`` over every record of every run that has it; None when none has."""
    xs = [x for r in runs for x in logged_values(r, key)]
    return statistics.fmean(xs) if xs else None


def mean_curve(runs: list[list[dict[str, Any]]], key: str, n: int) -> list[float | None]:
    """Per step 1..n, the mean of ``key`` over the runs that logged it at that step (None when none did)."""
    out: list[float | None] = []
    for i in range(n):
        xs = [float(r[i][key]) for r in runs if i < len(r) and isinstance(r[i].get(key), (int, float))]
        out.append(statistics.fmean(xs) if xs else None)
    return out


def _min(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def cell_diagnostics(runs: list[list[dict[str, Any]]], n: int) -> dict[str, Any]:
    """The logged diagnostics of the module doc over a cell's runs (``n``: the steps every run reached)."""
    active = mean_curve(runs, "active_frac", n)
    masked = [x for r in runs for x in logged_values(r, "behav_w/masked_frac")]
    return {"r_d_abs_logp_mean": pooled_mean(runs, "r_d/abs_logp_mean"),
            "abs_logp_anchor_minus_behav_mean": pooled_mean(runs, "abs_logp_anchor_minus_behav_mean"),
            "active_frac_curve": active, "active_frac_min": _min(active),
            "active_frac_min_any_seed": _min([x for r in runs for x in logged_values(r, "active_frac")]),
            "ewma_active_frac_pre_min": _min([x for r in runs for x in logged_values(r, "ewma/active_frac_pre")]),
            "masked_frac_mean": statistics.fmean(masked) if masked else None,
            "masked_frac_max": max(masked) if masked else None,
            "downweighted_frac_mean": pooled_mean(runs, "behav_w/downweighted_frac")}
