"""Least-squares fits the bench reports and the cost model use: a power law, and non-negative linear costs."""
from __future__ import annotations

import math

import numpy as np


def power_law(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """``y = coef * x**exponent`` by least squares on (log x, log y), over the points with x, y > 0.

    None when fewer than two distinct x remain. ``r2`` is the fit's coefficient of determination in log
    space (1 when the points lie on the line; 0 when the line explains nothing, or all y are equal).
    """
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2:
        return None
    lx = np.array([p[0] for p in pts])
    ly = np.array([p[1] for p in pts])
    exponent, log_coef = np.polyfit(lx, ly, 1)
    resid = ly - (exponent * lx + log_coef)
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 0.0
    return {"coef": float(math.exp(log_coef)), "exponent": float(exponent), "r2": r2, "n": len(pts)}


def nonneg_lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients c >= 0 minimizing sum((rows @ c - ys)**2) (active set: a term whose unconstrained
    coefficient is negative is dropped, i.e. set to 0, and the rest refitted). Costs are never negative."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]
