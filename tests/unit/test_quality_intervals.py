"""`megarl bench --quality`'s difference intervals: Student t quantiles against tabulated and closed-form values,
paired and Welch t intervals on hand-computed numbers, and their coverage of a true zero difference at 3 seeds
(the percentile bootstrap they replace, kept here only as a reference, falls short)."""
import itertools
import math

import numpy as np
import pytest
from scipy.stats import t as student_t

from megarl.bench import quality_stats


# -- Student t (scipy's: the tabulated values would catch a change upstream) --------------------------------
@pytest.mark.parametrize("df, expected", [(2, 2.919986), (4, 2.131847), (9, 1.833113), (30, 1.697261)])
def test_t_quantile_matches_tables(df, expected):
    # two-sided 90% (one-sided 95%) critical values of the usual t tables
    assert student_t.ppf(0.95, df) == pytest.approx(expected, abs=1e-6)
    # a Welch-Satterthwaite df between two integers lies between their quantiles
    assert student_t.ppf(0.95, 2) < student_t.ppf(0.95, 1.5) < student_t.ppf(0.95, 1)


# -- the intervals -----------------------------------------------------------------------------------
def test_paired_t_interval_hand_computed():
    # per-seed differences 0.1, 0.3, 0.2: mean 0.2, sd 0.1, se 0.1 / sqrt(3) = 0.0577350, t(0.95, 2) = 2.919986,
    # half-width 0.168586
    iv = quality_stats.diff_interval({0: 0.6, 1: 0.9, 2: 0.7}, {2: 0.5, 0: 0.5, 1: 0.6})  # keyed by seed, any order
    assert (iv["method"], iv["n"], iv["df"], iv["level"]) == ("paired t", 3, 2.0, 0.9)
    assert iv["diff"] == pytest.approx(0.2) and iv["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert iv["low"] == pytest.approx(0.031414, abs=1e-6) and iv["high"] == pytest.approx(0.368586, abs=1e-6)
    assert iv["verdict"] == "above behav"
    # the same values unpaired would span 0: pairing removes each seed's shared luck
    unpaired = quality_stats.welch_t_interval([0.6, 0.9, 0.7], [0.5, 0.5, 0.6])
    assert unpaired["low"] < 0 < unpaired["high"] and unpaired["diff"] == pytest.approx(0.2)
    # differences -0.1, -0.3, -0.2: the mirror image
    iv = quality_stats.paired_t_interval([0.5, 0.5, 0.6], [0.6, 0.8, 0.8])
    assert iv["low"] == pytest.approx(-0.368586, abs=1e-6) and iv["verdict"] == "below behav"
    # differences 0.1, -0.1: sd 0.141421, se 0.1, t(0.95, 1) = 6.313752 -> [-0.631375, +0.631375]
    iv = quality_stats.paired_t_interval([0.6, 0.4], [0.5, 0.5])
    assert iv["low"] == pytest.approx(-0.631375, abs=1e-6) and iv["high"] == pytest.approx(0.631375, abs=1e-6)
    assert iv["verdict"] == "no difference detectable at this n"
    assert quality_stats.paired_t_interval([0.6], [0.5]) is None


def test_welch_t_interval_hand_computed():
    # a = 1, 2, 3 (var 1), b = 1, 3 (var 2): se^2 = 1/3 + 2/2 = 4/3;
    # df = (4/3)^2 / ((1/3)^2 / 2 + 1^2 / 1) = (16/9) / (19/18) = 32/19
    iv = quality_stats.diff_interval({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.0, 5: 3.0})
    assert (iv["method"], iv["n_a"], iv["n_b"], iv["n"]) == ("Welch t", 3, 2, None)
    assert iv["diff"] == pytest.approx(0.0) and iv["se"] == pytest.approx(math.sqrt(4 / 3))
    assert iv["df"] == pytest.approx(32 / 19)
    half = student_t.ppf(0.95, 32 / 19) * math.sqrt(4 / 3)
    assert (iv["low"], iv["high"]) == (pytest.approx(-half), pytest.approx(half))
    assert iv["verdict"] == "no difference detectable at this n"
    # b constant: df = n_a - 1 = 2; a = 1, 2, 3 vs b = 0, 0: diff 2, se sqrt(1/3) = 0.577350, half 1.685854
    iv = quality_stats.welch_t_interval([1.0, 2.0, 3.0], [0.0, 0.0])
    assert iv["df"] == pytest.approx(2.0)
    assert iv["low"] == pytest.approx(0.314146, abs=1e-6) and iv["high"] == pytest.approx(3.685854, abs=1e-6)
    assert iv["verdict"] == "above behav"
    # another level: t(0.975, 4) = 2.776445 for equal n = 3 and variances (df 4), se sqrt(2/3)
    iv = quality_stats.welch_t_interval([1.0, 2.0, 3.0], [0.5, 1.5, 2.5], level=0.95)
    assert iv["df"] == pytest.approx(4.0) and iv["high"] - iv["diff"] == pytest.approx(2.776445 * 0.816497, abs=1e-5)
    assert quality_stats.welch_t_interval([1.0], [0.0, 1.0]) is None


# -- coverage at 3 seeds -------------------------------------------------------------------------------
def _old_bootstrap_covers(a: np.ndarray, b: np.ndarray, level: float = 0.9) -> np.ndarray:
    """The former percentile bootstrap (each cell resampled on its own), with its resampling distribution
    enumerated exactly: every one of the n^n resamples of a and of b, equally likely."""
    n_exp, n = a.shape
    idx = np.array(list(itertools.product(range(n), repeat=n)))
    diffs = np.sort((a[:, idx].mean(axis=2)[:, :, None] - b[:, idx].mean(axis=2)[:, None, :]).reshape(n_exp, -1),
                    axis=1)
    m = diffs.shape[1]
    low, high = diffs[:, math.ceil(m * (1 - level) / 2) - 1], diffs[:, math.ceil(m * (1 + level) / 2) - 1]
    return (low <= 0) & (0 <= high)


def test_t_intervals_cover_a_true_zero_difference_at_three_seeds():
    """2000 simulated experiments, 3 seeds a cell, both cells N(0, 1): the true difference is 0. The 90% paired t
    interval covers it ~90% of the time (it is exact for normal data), Welch's a little more (it is
    conservative at equal variances); the old bootstrap only ~74%."""
    rng = np.random.default_rng(20240601)
    a, b = rng.normal(size=(2000, 3)), rng.normal(size=(2000, 3))
    paired = [quality_stats.paired_t_interval(x, y) for x, y in zip(a.tolist(), b.tolist())]
    coverage = sum(iv["low"] <= 0 <= iv["high"] for iv in paired) / len(paired)
    assert 0.85 <= coverage <= 0.95
    assert sum(iv["verdict"] != "no difference detectable at this n" for iv in paired) == round(2000 * (1 - coverage))
    welch = [quality_stats.welch_t_interval(x, y) for x, y in zip(a[:1000].tolist(), b[:1000].tolist())]
    assert 0.85 <= sum(iv["low"] <= 0 <= iv["high"] for iv in welch) / len(welch) <= 0.97
    assert _old_bootstrap_covers(a, b).mean() < 0.8  # negative control: the interval this replaced
