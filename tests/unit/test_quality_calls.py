"""What a grid's report calls a difference: nothing below 5 seeds a side, and Holm over the grid's comparisons."""
from __future__ import annotations

import pytest

from megarl.bench.quality_runs import behav_diffs, vs_behav_table
from megarl.bench.quality_stats import holm, p_value

SEEDS = [0, 1, 2, 3, 4]
BEHAV = [0.10, 0.20, 0.15, 0.12, 0.18]


def _row(strategy: str, diffs: list[float], seeds=SEEDS) -> dict:
    per_seed = [b + d for b, d in zip(BEHAV, diffs)]
    return {"strategy": strategy, "eta": 8, "seeds": seeds, "per_seed": per_seed,
            "mean": sum(per_seed) / len(per_seed)}


def test_holm_steps_down_until_the_first_that_fails():
    # alpha 0.1, m = 4: thresholds 0.025, 0.0333, 0.05, 0.1 for the ascending p-values
    assert holm([0.01, 0.03, 0.2, 0.04], 0.1) == [True, True, False, True]  # 0.04 <= 0.05; 0.2 > 0.1
    assert holm([0.03, 0.01], 0.1) == [True, True]  # 0.01 <= 0.05, then 0.03 <= 0.1
    assert holm([0.06, 0.07], 0.1) == [False, False]  # the smallest already fails 0.05
    assert holm([], 0.1) == []


def test_a_difference_is_called_only_at_5_seeds_and_after_holm():
    behav = {"strategy": "behav", "eta": 8, "seeds": SEEDS, "per_seed": BEHAV, "mean": sum(BEHAV) / 5}
    # ewma: paired differences mean 0.304, se 0.0051, t = 59.6 (p 4.7e-7); snapshot: mean 0.06, se 0.02168,
    # t = 2.768, p = 0.0505, its own 90% interval [+0.0138, +0.1062] excludes 0; linear: no difference.
    # Holm at alpha 0.1 over 3: 4.7e-7 <= 0.0333, then 0.0505 > 0.05: snapshot is not called
    rows = [behav, _row("ewma", [0.30, 0.32, 0.29, 0.31, 0.30]), _row("snapshot", [0.10, 0.02, 0.05, 0.12, 0.01]),
            _row("linear", [0.05, -0.05, 0.02, -0.02, 0.0])]
    ewma, snap, linear = behav_diffs(rows)
    assert p_value(ewma["interval"]) == pytest.approx(4.74e-7, rel=1e-2) and ewma["verdict"] == "above behav"
    assert p_value(snap["interval"]) == pytest.approx(0.050455, abs=1e-6)
    assert snap["interval"]["low"] == pytest.approx(0.013783, abs=1e-6) and snap["interval"]["verdict"] == "above behav"
    assert snap["verdict"] == "no difference called after Holm"
    assert linear["verdict"] == "no difference detectable at this n"
    # without the null comparison the family is 2: 0.0505 <= 0.1 and snapshot is called
    assert [d["verdict"] for d in behav_diffs(rows[:3])] == ["above behav", "above behav"]
    # the same differences at 4 seeds: not called, however clear
    four = [{**r, "seeds": r["seeds"][:4], "per_seed": r["per_seed"][:4]} for r in rows[:2]]
    (d,) = behav_diffs(four)
    assert d["interval"]["verdict"] == "above behav" and d["verdict"] == "not called at n < 5"
    table = "\n".join(vs_behav_table({"vs_behav": behav_diffs(rows), "level": 0.9}))
    assert ("| snapshot | 8 | +0.0600 | [+0.0138, +0.1062] | 5 pairs | paired t | 4.0 | "
            "no difference called after Holm |") in table
    assert "Holm's step-down correction over the 3 comparisons of this table at alpha = 0.10" in table
