"""The numbers `megarl bench --quality` reports per cell (strategy variant x eta, over its seeds).

Steps to a reward threshold (:func:`steps_to_threshold`): per seed, the first
optimizer step (1-based) at which the smoothed batch reward (the curves' trailing
moving average) is at least the threshold, ``None`` when it never gets there.
Over the seeds (:func:`threshold_summary`): how many reached it, the median with
"not reached" counted as later than any step (``None`` when the median seed did
not reach it) and the mean over the seeds that reached it.

Difference to behav (:func:`bootstrap_diff`): final-window reward of a cell minus
that of behav at the same eta, as the difference of the two means over seeds,
with a percentile bootstrap interval. Each of ``n_resamples`` rounds draws, with
replacement, as many seeds as each cell has from that cell alone (the two cells
resampled independently) and takes the difference of the two resampled means;
the interval at ``level`` runs from the (k+1)-th smallest to the (k+1)-th largest
of the sorted differences, k = floor(n_resamples (1 - level) / 2) (level 0.9 and
2000 resamples: the 101st and the 1900th). The draws come from
``random.Random(seed)``, so the same inputs give the same interval. It needs at
least two seeds in each cell; with fewer it is ``None``.

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
import random
import statistics
from typing import Any

BOOTSTRAP_LEVEL = 0.9
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def steps_to_threshold(smoothed: list[float], threshold: float) -> int | None:
    """First step (1-based) whose smoothed reward is >= ``threshold``; None when none is."""
    return next((i + 1 for i, x in enumerate(smoothed) if x >= threshold), None)


def threshold_summary(per_seed: list[int | None]) -> dict[str, Any]:
    reached = [s for s in per_seed if s is not None]
    median = statistics.median([math.inf if s is None else float(s) for s in per_seed]) if per_seed else math.inf
    return {"per_seed": per_seed, "reached": len(reached), "of": len(per_seed),
            "median": None if math.isinf(median) else median,
            "mean": statistics.fmean(reached) if reached else None}


def bootstrap_diff(a: list[float], b: list[float], *, level: float = BOOTSTRAP_LEVEL,
                   n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any] | None:
    """mean(a) - mean(b) and its bootstrap interval (module doc); None with fewer than 2 values on a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(seed)
    diffs = sorted(statistics.fmean(rng.choices(a, k=len(a))) - statistics.fmean(rng.choices(b, k=len(b)))
                   for _ in range(n_resamples))
    k = math.floor(n_resamples * (1.0 - level) / 2.0 + 1e-9)  # + 1e-9: (1 - 0.9) / 2 is 0.04999... in floats
    return {"diff": statistics.fmean(a) - statistics.fmean(b), "low": diffs[k], "high": diffs[-k - 1],
            "level": level, "n_resamples": n_resamples, "seed": seed}


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]


def pooled_mean(runs: list[list[dict[str, Any]]], key: str) -> float | None:
    """Mean of ``key`` over every record of every run that has it; None when none has."""
    xs = [x for r in runs for x in _values(r, key)]
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
    masked = [x for r in runs for x in _values(r, "behav_w/masked_frac")]
    return {"r_d_abs_logp_mean": pooled_mean(runs, "r_d/abs_logp_mean"),
            "abs_logp_anchor_minus_behav_mean": pooled_mean(runs, "abs_logp_anchor_minus_behav_mean"),
            "active_frac_curve": active, "active_frac_min": _min(active),
            "active_frac_min_any_seed": _min([x for r in runs for x in _values(r, "active_frac")]),
            "ewma_active_frac_pre_min": _min([x for r in runs for x in _values(r, "ewma/active_frac_pre")]),
            "masked_frac_mean": statistics.fmean(masked) if masked else None,
            "masked_frac_max": max(masked) if masked else None,
            "downweighted_frac_mean": pooled_mean(runs, "behav_w/downweighted_frac")}
