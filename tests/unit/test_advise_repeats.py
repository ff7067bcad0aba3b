"""`megarl advise`'s timing runs interleaved and repeated (megarl/advise/costs.py), and the rules that say when a
measured cost difference sits inside its interval and fall back to the cost-free rule (megarl/advise/rules.py)."""
from __future__ import annotations

import copy

from test_advise_rules import ALL_RUNS, _m
from test_bench_interleave import Machine, _fake_run

from megarl.advise import costs, rules
from megarl.advise.report import render_markdown


def _time(names, repeats, deadline, machine, logs):
    calls: list[str] = []
    timed = costs.time_strategies("c.yaml", [], names, 5, _Out(), None, deadline, logs.append, repeats=repeats,
                                  run=_fake_run(machine, calls), now=lambda: machine.clock)
    return timed, calls


class _Out:
    """Stands in for the output directory: run directories as strings."""

    def __truediv__(self, name):
        return _Path(name)


class _Path(str):
    def __truediv__(self, name):
        return _Path(f"{self}/{name}")


def test_timing_runs_alternate_and_each_cost_carries_its_interval_over_the_repeats():
    timed, calls = _time(["behav", "ewma"], 3, 1e9, Machine(seed=2), logs := [])
    assert calls == ["behav", "ewma", "repeats/ewma_2", "repeats/behav_2", "repeats/behav_3", "repeats/ewma_3"]
    assert timed["repeats_done"] == 3 and timed["order"] == [[0, "behav"], [0, "ewma"], [1, "ewma"], [1, "behav"],
                                                             [2, "behav"], [2, "ewma"]]
    ewma = timed["runs"]["ewma"]
    assert len(ewma["per_repeat"]) == 3 and ewma["share_interval"]["n"] == 3
    share = ewma["share_interval"]  # its own 0.12 s of a 0.92 s step, each step's CPU seconds +-3%
    assert share["low"] <= share["share"] <= share["high"] and abs(share["share"] - 0.12 / 0.92) < 0.005, share
    ratio = ewma["step_ratio_to_behav"]  # 0.92 s / behav's 0.80 s
    assert ratio["low"] <= ratio["ratio"] <= ratio["high"] and abs(ratio["ratio"] - 0.92 / 0.80) < 0.05, ratio
    d = ewma["step_minus_behav_interval"]
    assert d["low"] <= d["mean"] <= d["high"] and abs(ewma["step_minus_behav_s"] - 0.12) < 0.04, d
    assert timed["runs"]["behav"]["step_ratio_to_behav"]["ratio"] == 1.0
    assert any("(repeat 3 of 3)" in line for line in logs)


def test_a_later_round_runs_only_when_all_of_it_fits_the_budget():
    machine = Machine(seed=0)
    one_run = 6.0 + 3.0 + 5 * 0.8 + 0.5  # start, first step, 5 steps of behav or ewma: about 14 s
    timed, calls = _time(["behav", "ewma"], 3, 5 * one_run, machine, logs := [])
    assert timed["repeats_done"] == 2 and len(calls) == 4
    assert any("repeat 3 of 3: not started (time budget" in line for line in logs)
    assert len(timed["runs"]["ewma"]["per_repeat"]) == 2
    # a budget for one run only: round 1 skips ewma, names why, and no later round starts
    timed, calls = _time(["behav", "ewma"], 3, one_run, Machine(seed=0), [])
    assert calls == ["behav"] and timed["skipped"]["ewma"].startswith("time budget")
    assert timed["repeats_done"] == 1 and timed["runs"]["behav"]["share_interval"]["low"] is None


def _with_repeats(m, name, shares, step=1.0):
    m["cost"]["runs"][name]["per_repeat"] = [{"added_step_s": s * step, "step_time_s_median": step} for s in shares]
    from megarl.bench.interleave import share_interval

    m["cost"]["runs"][name]["share_interval"] = share_interval([s * step for s in shares], [step] * len(shares))
    return m


def test_ewma_whose_cost_interval_holds_the_threshold_falls_back_to_the_cost_free_rule():
    # median 0.30 of its step (> 25%: linear on the point), but one loaded repeat made the repeats disagree
    m = _with_repeats(_m(lag=3.0, runs={**ALL_RUNS, "ewma": (0.30, 1.0)}), "ewma", [0.10, 0.30, 0.55])
    name, why = rules.by_staleness(m)
    assert name == "ewma", why
    assert "holds 25%: the measured cost does not decide, so the cost-free rule: ewma" in why
    assert "over 3 interleaved repeats" in why
    # repeats that agree above 25% still choose linear, and say so with the interval
    m = _with_repeats(_m(lag=3.0, runs={**ALL_RUNS, "ewma": (0.40, 1.0)}), "ewma", [0.39, 0.40, 0.41])
    name, why = rules.by_staleness(m)
    assert name == "linear" and "(40% [" in why and "over 3 repeats) (> 25%)" in why
    # and repeats that agree below it choose ewma on the cost
    m = _with_repeats(_m(lag=3.0, runs=ALL_RUNS), "ewma", [0.09, 0.10, 0.11])
    assert rules.by_staleness(m)[0] == "ewma" and "(<= 25%)" in rules.by_staleness(m)[1]
    # out of memory: no interval makes it fit
    m = _with_repeats(_m(lag=3.0, runs=ALL_RUNS, fits={"ewma": False}), "ewma", [0.10, 0.30, 0.55])
    assert rules.by_staleness(m)[0] == "linear"


def test_exact_strategies_whose_cost_difference_holds_zero_fall_back_to_the_cost_free_order():
    runs = {**ALL_RUNS, "interrupt_sync": (0.29, 1.29), "snapshot": (0.30, 1.30)}
    m = _m(masked=0.05, lag=3.0, runs=runs)
    m = _with_repeats(_with_repeats(m, "interrupt_sync", [0.20, 0.29, 0.40]), "snapshot", [0.25, 0.30, 0.33])
    m = _with_repeats(m, "dedicated", [0.50, 0.52, 0.49])
    name, why = rules.cheapest_fitting_exact(m)
    assert name == "snapshot", why
    assert why.startswith("interrupt_sync measured cheapest (0.290 s") and "its difference to snapshot" in why
    assert "the cost-free order snapshot, interrupt_sync, dedicated: snapshot" in why and "dedicated -" not in why
    # a difference the repeats resolve: the cheapest stays
    m = _with_repeats(_with_repeats(m, "snapshot", [0.40, 0.41, 0.42]), "interrupt_sync", [0.28, 0.29, 0.30])
    m["cost"]["runs"]["snapshot"]["added_step_s"] = 0.41
    assert rules.cheapest_fitting_exact(m)[0] == "interrupt_sync"


def test_the_table_shows_each_cost_with_its_interval_and_how_it_was_measured():
    m = _with_repeats(_m(lag=3.0, runs=ALL_RUNS), "ewma", [0.09, 0.10, 0.11], step=1.1)
    m["cost"].update(steps=4, repeats=3, repeats_done=3)
    from megarl.bench.interleave import ratio_interval

    m["cost"]["runs"]["ewma"]["step_ratio_to_behav"] = ratio_interval([1.1, 1.1, 1.1], [1.0, 1.0, 1.0])
    m["recommendation"] = rules.recommend(copy.deepcopy(m))
    text = render_markdown(m)
    assert "| ewma (chosen) | +0.100 s of 1.100 s (10.0% [8.3%, 11.7%]); step 1.100 [1.100, 1.100] x behav's |" \
        in text
    assert "Costs: medians over 3 of 3 repeats of 4 steps, interleaved" in text and "90% t interval" in text
