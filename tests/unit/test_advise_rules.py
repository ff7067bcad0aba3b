"""`megarl advise`'s decision rules on hand-made measurements: every branch of megarl/advise/rules.py."""
from __future__ import annotations

import copy

from megarl.advise import rules
from megarl.advise.report import render_markdown


def _m(*, masked=0.0, down=0.0, behav_clip=0.0, lag=0.3, runs=None, fits=None, moe=False, routes=None):
    """A measurement set like advise.json's: r_d ~2e-3 and nothing masked unless told."""
    names = ("behav", "loglinear", "linear", "recompute", "ewma", "snapshot", "interrupt_sync", "dedicated")
    fits = fits or {}
    runs = {} if runs is None else runs
    m = {"config": {"eta": 8, "moe": moe, "routing_replay": False},
         "calibration": {"n_batches": 20,
                         "gap": {"mean": 2e-3, "p50": 1e-3, "p99": 2e-2, "max": 0.3, "n": 1000},
                         "rule": {"masked_frac": masked, "downweighted_frac": down},
                         "staleness": {"lag_mean": lag, "lag_max": 8, "spliced_frac": 0.4},
                         "anchors": {n: {"mean": 0.1, "p99": 0.5, "clip_differs_frac": 0.05}
                                     for n in ("ewma", "recompute", "loglinear", "linear")}},
         "cost": {"runs": {n: {"added_step_s": a, "step_time_s_median": s} for n, (a, s) in runs.items()},
                  "skipped": {}},
         "memory": {"device": "cpu", "strategies": {n: {"fits": fits.get(n, True), "host_gb_per_node": 0.0,
                                                        "trainer_gpu_gb": None, "dedicated_gpus": 0,
                                                        "dedicated_gpu_gb": 0.0, "problems": []} for n in names}}}
    m["calibration"]["anchors"]["behav"] = {"mean": 2e-3, "p99": 2e-2, "clip_differs_frac": behav_clip}
    if routes is not None:
        m["calibration"]["routes"] = {"same_version": {"tokens_differ_frac": routes}, "r_d_abs_mean_no_replay": 3e-3}
    return m


ALL_RUNS = {"behav": (0.0, 1.0), "ewma": (0.1, 1.1), "snapshot": (0.3, 1.3), "interrupt_sync": (0.2, 1.2),
            "dedicated": (0.5, 1.5)}


def test_fresh_tokens_and_a_gap_that_changes_nothing_choose_behav():
    rec = rules.recommend(_m(lag=0.3, runs=ALL_RUNS))
    assert rec["strategy"] == "behav" and rec["exactness_matters"] is False
    assert "cannot change the update" in rec["reasons"][0] and "0.30 optimizer steps" in rec["reasons"][1]


def test_a_share_at_the_threshold_is_still_negligible_and_one_above_it_is_not():
    at = rules.NEGLIGIBLE_SHARE
    assert rules.exactness_can_change_update(_m(masked=at / 2, down=at / 2))[0] is False
    assert rules.exactness_can_change_update(_m(masked=at, down=0.001))[0] is True


def test_stale_tokens_choose_ewma_when_it_is_cheap_and_fits():
    rec = rules.recommend(_m(lag=3.0, runs=ALL_RUNS))
    assert rec["strategy"] == "ewma" and "0.100 s of its own to a 1.100 s step" in rec["reasons"][1]


def test_stale_tokens_choose_linear_when_ewma_is_expensive_unmeasured_or_does_not_fit():
    costly = {**ALL_RUNS, "ewma": (0.5, 1.5)}  # 33% of its step > 25%
    assert rules.by_staleness(_m(lag=3.0, runs=costly))[0] == "linear"
    assert "(> 25%)" in rules.by_staleness(_m(lag=3.0, runs=costly))[1]
    assert rules.by_staleness(_m(lag=3.0, runs={}))[1].endswith("ewma was not measured, so linear (no forward)")
    name, why = rules.by_staleness(_m(lag=3.0, runs=ALL_RUNS, fits={"ewma": False}))
    assert name == "linear" and "does not fit" in why


def test_a_gap_the_rule_acts_on_chooses_the_cheapest_exact_strategy_that_fits():
    rec = rules.recommend(_m(masked=0.05, lag=3.0, runs=ALL_RUNS))
    assert rec["strategy"] == "interrupt_sync" and rec["exactness_matters"] is True
    # interrupt_sync out of memory: snapshot is next
    assert rules.recommend(_m(down=0.05, runs=ALL_RUNS, fits={"interrupt_sync": False}))["strategy"] == "snapshot"


def test_clip_decisions_that_differ_from_behavs_anchor_make_exactness_matter_on_their_own():
    rec = rules.recommend(_m(behav_clip=0.03, runs=ALL_RUNS))
    assert rec["exactness_matters"] is True and rec["strategy"] == "interrupt_sync"
    assert "clips 3.00% of them differently" in rec["reasons"][0]


def test_without_a_measured_exact_strategy_the_choice_falls_back_to_staleness():
    rec = rules.recommend(_m(masked=0.2, lag=3.0, runs={"behav": (0.0, 1.0), "ewma": (0.1, 1.1)}))
    assert rec["strategy"] == "ewma"
    assert "not measured: snapshot, interrupt_sync, dedicated" in rec["reasons"][1]
    assert rec["reasons"][2].startswith("falling back to staleness")


def test_routing_replay_is_turned_on_only_for_an_moe_model_whose_routers_flip_often():
    assert rules.routing_replay(_m())[0] is None  # dense
    assert rules.routing_replay(_m(moe=True))[0] is None  # no routes counted
    assert rules.routing_replay(_m(moe=True, routes=0.02))[0] is False
    on = rules.recommend(_m(moe=True, routes=0.12, runs=ALL_RUNS))
    assert on["routing_replay"] is True and "turn rollout.routing_replay on" in on["reasons"][-1]


def test_the_table_names_the_choice_and_says_what_was_not_measured():
    m = _m(lag=3.0, runs=ALL_RUNS)
    m["cost"]["skipped"]["linear"] = "time budget: 0 s left"
    m["recommendation"] = rules.recommend(copy.deepcopy(m))
    text = render_markdown(m)
    assert "| ewma (chosen) | +0.100 s of 1.100 s |" in text
    assert "not measured: time budget: 0 s left" in text and text.rstrip().endswith(".")
    assert "Recommended: ewma." in text


def test_bad_arguments_get_one_error_naming_the_flag_and_what_works():
    import pytest

    from megarl.advise.calibrate import check_args
    from megarl.errors import ConfigError

    for args, said in (((1, 4, 60.0), "--steps 1: the calibration needs at least 2 steps"),
                       ((20, 1, 60.0), "--cost-steps 1: give 0 (no cost runs) or at least 2"),
                       ((20, 4, 0.0), "--time-budget-s 0.0: give a positive number of seconds")):
        with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
            check_args(*args)
    check_args(2, 0, 1.0)  # the smallest calibration, no cost runs
