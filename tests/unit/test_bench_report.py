"""Bench aggregation on hand-made metrics records with hand-computed results."""
import json
import math

import pytest

from megarl.bench import report as R
from megarl.bench import report_render

# Three steps as the controller + bench wrapper log them. va / vp: verifier seconds
# inside anchor / publish, which the report subtracts.
STEPS = [
    {"step": 1, "wait_batch_s": 1.0, "recovery_s": 0.30, "train_step_s": 0.50, "publish_s": 0.12,
     "publish_drain_s": 0.05, "publish_recovery_s": 0.02, "weight_sync_s": 0.03, "step_s": 2.0, "wall_s": 2.0,
     "gen_stall_total_s": 0.12, "tokens": 100, "reward_mean": 0.1, "verify/max_abs_err": 0.0,
     "recovery/bench_verifier_anchor_s": 0.10, "recovery/bench_verifier_publish_s": 0.01,
     "recovery/bench_hook_publish_s": 0.01, "recovery/bench_hook_optimizer_s": 0.0,
     "recovery/extra_param_copies": 1.0, "recovery/bytes_moved": 1000.0},
    {"step": 2, "wait_batch_s": 0.0, "recovery_s": 0.50, "train_step_s": 0.60, "publish_s": 0.22,
     "publish_drain_s": 0.10, "publish_recovery_s": 0.04, "weight_sync_s": 0.06, "step_s": 1.5, "wall_s": 3.5,
     "gen_stall_total_s": 0.34, "tokens": 200, "reward_mean": 0.2, "verify/max_abs_err": 1e-6,
     "recovery/bench_verifier_anchor_s": 0.20, "recovery/bench_verifier_publish_s": 0.01,
     "recovery/bench_hook_publish_s": 0.01, "recovery/bench_hook_optimizer_s": 0.02,
     "recovery/extra_param_copies": 3.0, "recovery/bytes_moved": 2000.0},
    # the last step does not publish
    {"step": 3, "wait_batch_s": 0.2, "recovery_s": 0.25, "train_step_s": 0.55, "step_s": 1.0, "wall_s": 4.5,
     "gen_stall_total_s": 0.34, "tokens": 300, "reward_mean": 0.3, "verify/max_abs_err": 2e-6,
     "recovery/bench_verifier_anchor_s": 0.15, "recovery/bench_hook_optimizer_s": 0.01,
     "recovery/extra_param_copies": 2.0, "recovery/bytes_moved": 500.0},
]
# corrected per step (hand-computed):
#   recovery = 0.30-0.10, 0.50-0.20, 0.25-0.15          = 0.20, 0.30, 0.10
#   step     = 2.0-0.11, 1.5-0.21, 1.0-0.15             = 1.89, 1.29, 0.85
#   critical = 0.20+0.02+0.01, 0.30+0.04+0.03, 0.10+0+0.01 = 0.23, 0.37, 0.11
#   wall     = 2.0-0.11, 3.5-0.32, 4.5-0.47             = 1.89, 3.18, 4.03
#   stall    = 0.12-0.01, 0.34-0.02, 0.34-0.02          = 0.11, 0.32, 0.32
WEIGHTS = 10_000


def approx(x):
    return pytest.approx(x, abs=1e-9)


def test_step_phases_subtract_the_verifier():
    ph = R.step_phases(STEPS)
    assert [p["recovery"] for p in ph] == approx([0.20, 0.30, 0.10])
    assert [p["step"] for p in ph] == approx([1.89, 1.29, 0.85])
    assert [p["critical"] for p in ph] == approx([0.23, 0.37, 0.11])
    assert [p["wall"] for p in ph] == approx([1.89, 3.18, 4.03])
    assert [p["gen_stall_total"] for p in ph] == approx([0.11, 0.32, 0.32])
    # other = step - named phases: 1.89 - (1.0+0.2+0.5+0.05+0.02+0.03+0.01)
    assert ph[0]["other"] == approx(0.08)
    assert ph[2]["other"] == approx(0.85 - (0.2 + 0.10 + 0.55 + 0.01))
    # the named phases and other add up to the step
    for p in ph:
        assert sum(p[k] for k in R.PHASES) == approx(p["step"])


def test_summarize_hand_computed():
    # run-level times over steps 2..3 (step 1 holds start-up)
    s = R.summarize(STEPS, weights_nbytes=WEIGHTS, peak_rss_mb=512.5)
    assert s == {
        "step_time_s_median": approx((1.29 + 0.85) / 2),
        "recovery_s_median": approx((0.30 + 0.10) / 2),
        "critical_path_overhead_frac": approx((0.37 + 0.11) / (1.29 + 0.85)),
        "gen_stall_frac": approx((0.32 - 0.11) / (4.03 - 1.89)),
        "peak_rss_mb": 512.5,
        "extra_param_copies": 3.0,
        "bytes_moved": 3500 + 2 * WEIGHTS,  # recovery bytes + 2 publishes x one checkpoint
        "max_abs_err_vs_exact": approx(2e-6),
    }
    assert isinstance(s["bytes_moved"], int)


def test_plain_metrics_without_bench_keys():
    # a metrics.jsonl of `megarl train` (no verifier, no strategy meter): nothing subtracted, zeros
    plain = [{k: v for k, v in r.items() if not k.startswith(("recovery/", "verify/"))} for r in STEPS]
    s = R.summarize(plain, weights_nbytes=0, peak_rss_mb=0.0, verified=False)
    assert s["step_time_s_median"] == approx((1.5 + 1.0) / 2)
    assert s["recovery_s_median"] == approx((0.50 + 0.25) / 2)
    # (0.50+0.04) + 0.25 over 1.5 + 1.0
    assert s["critical_path_overhead_frac"] == approx(0.79 / 2.5)
    assert s["gen_stall_frac"] == approx((0.34 - 0.12) / (4.5 - 2.0))
    # a single step is all there is
    one = R.summarize(plain[:1], weights_nbytes=0, peak_rss_mb=0.0, verified=False)
    assert one["step_time_s_median"] == approx(2.0)
    assert one["critical_path_overhead_frac"] == approx(0.32 / 2.0)
    assert one["gen_stall_frac"] == approx(0.12 / 2.0)
    assert s["extra_param_copies"] == 0.0 and s["bytes_moved"] == 0
    assert s["max_abs_err_vs_exact"] is None


def test_non_finite_verifier_error_is_null():
    steps = [dict(r) for r in STEPS]
    steps[1]["verify/max_abs_err"] = None  # RunLogger writes a non-finite value as null
    assert R.summarize(steps, WEIGHTS, 1.0)["max_abs_err_vs_exact"] is None


def test_phase_medians_over_steps_2_to_n():
    m = R.phase_medians(STEPS)
    assert m["wait_batch"] == approx(0.1)
    assert m["recovery"] == approx(0.2)
    assert m["train_step"] == approx(0.575)
    assert m["publish_drain"] == approx(0.05)  # the last step has none: 0
    assert m["recovery_hooks"] == approx(0.02)
    assert m["step"] == approx(1.07)


def test_tokens_per_s_excludes_the_first_step():
    # corrected wall 1.89 -> 4.03, tokens of steps 2 and 3
    assert R.tokens_per_s(STEPS) == approx(500 / 2.14)
    with pytest.raises(ValueError):
        R.tokens_per_s(STEPS[:1])


def _run(records, copies_rss=100.0):
    return {"records": records, "child": {"peak_rss_mb": copies_rss}, "weights_nbytes": WEIGHTS}


def test_build_report_and_throughput_ratio():
    fast = [{"wall_s": w, "tokens": t, "step_s": 1.0} for w, t in ((1.0, 50), (2.0, 100), (3.0, 100))]
    slow = [{"wall_s": w, "tokens": t, "step_s": 2.0} for w, t in ((2.0, 50), (4.0, 100), (6.0, 100))]
    rep = R.build_report({"snapshot": _run(STEPS)}, {"async": fast, "sync": slow}, meta={"steps": 3})
    assert rep["async_vs_sync"] == {"throughput_ratio": approx(2.0), "tokens_per_s_async": approx(100.0),
                                    "tokens_per_s_sync": approx(50.0), "throughput_ratio_disjoint_cores": None}
    assert set(rep["strategies"]["snapshot"]) == {
        "step_time_s_median", "recovery_s_median", "critical_path_overhead_frac", "gen_stall_frac",
        "peak_rss_mb", "extra_param_copies", "bytes_moved", "max_abs_err_vs_exact"}
    json.dumps(rep, allow_nan=False)
    assert R.build_report({"snapshot": _run(STEPS)}, None)["async_vs_sync"] == {
        "throughput_ratio": None, "throughput_ratio_disjoint_cores": None}
    # on disjoint cores: async 200 tokens / 1 s, sync 200 tokens / 4 s
    pinned_async = [{"wall_s": w, "tokens": 100} for w in (1.0, 1.5, 2.0)]
    pinned_sync = [{"wall_s": w, "tokens": 100} for w in (2.0, 4.0, 6.0)]
    both = R.throughput({"async": fast, "sync": slow, "async_disjoint": pinned_async, "sync_disjoint": pinned_sync})
    assert both["throughput_ratio"] == approx(2.0) and both["throughput_ratio_disjoint_cores"] == approx(4.0)
    assert both["tokens_per_s_async_disjoint"] == approx(200.0) and both["tokens_per_s_sync_disjoint"] == approx(50.0)


def _entry(step=1.0, crit=0.0, stall=0.0):
    return {"step_time_s_median": step, "critical_path_overhead_frac": crit, "gen_stall_frac": stall}


def test_targets_pass_fail_and_skip():
    strategies = {"ewma": _entry(1.04), "recompute": _entry(1.0), "snapshot": _entry(1.6),
                  "dedicated": _entry(crit=0.08), "interrupt_sync": _entry(stall=0.05)}
    got = {t["target"]: (t["value"], t["passed"]) for t in R.targets(strategies, {"throughput_ratio": None})}
    assert got["ewma step time / recompute step time"] == (approx(1.04), True)
    assert got["snapshot step time / ewma step time"] == (approx(1.6 / 1.04), False)
    assert got["dedicated: recovery share of the trainer critical path"] == (approx(0.08), False)
    assert got["interrupt_sync: engine stall share of wall time"] == (approx(0.05), True)
    assert got["async / sync throughput (tokens/s)"] == (None, None)
    only_ewma = R.targets({"ewma": _entry()}, {"throughput_ratio": 1.2, "throughput_ratio_disjoint_cores": 2.5})
    assert [t["passed"] for t in only_ewma] == [None, None, None, None, False, True]
    assert only_ewma[-1]["target"] == "async / sync throughput on disjoint cores (tokens/s)"


def test_markdown_lists_targets_with_measured_values():
    rep = R.build_report({"ewma": _run(STEPS), "recompute": _run(STEPS)}, None, meta={"config": "c.yaml", "steps": 3})
    md = report_render.render_markdown(rep)
    assert "| ewma | 1.0700 | 0.2000 | 22.4 | 9.8 | 100 | 3 | 0.0 | 2.00e-06 |" in md
    assert "PASS  ewma step time / recompute step time: 1.000 (target <= 1.05)" in md
    assert "SKIP  async / sync throughput (tokens/s): not measured (target >= 2)" in md
    assert not math.isnan(rep["strategies"]["ewma"]["critical_path_overhead_frac"])
    assert "Config `c.yaml`, 3 steps per run, eta=?, one run each, one after another." in md
    rep["meta"].update(overrides=["trainer.batch_size=16"], cpu_count=2, loadavg_start=1.5, loadavg_end=2.25)
    md = report_render.render_markdown(rep)
    assert "Config `c.yaml` with `trainer.batch_size=16`, 3 steps" in md
    assert "Machine: 2 CPUs, load average 1.50 at the start and 2.25 at the end" in md


# -- publish stall, scorer lag ----------------------------------------------------------------------
STALL_STEPS = [
    {"publish_stall_s": 0.050, "publish_drain_s": 0.010, "publish_recovery_s": 0.005, "weight_sync_s": 0.030,
     "engine_abort_s": 0.0, "engine_pause_s": 0.0, "engine_reload_s": 0.020, "engine_cache_reset_s": 0.002,
     "engine_resume_s": 0.001, "recovery/bench_hook_publish_s": 0.004, "recovery/bench_verifier_publish_s": 0.001},
    {"publish_stall_s": 0.070, "publish_drain_s": 0.020, "publish_recovery_s": 0.005, "weight_sync_s": 0.040,
     "engine_abort_s": 0.0, "engine_pause_s": 0.0, "engine_reload_s": 0.030, "engine_cache_reset_s": 0.002,
     "engine_resume_s": 0.001, "recovery/bench_hook_publish_s": 0.002},
    {"step": 3},  # the last step does not publish
]


def test_publish_stall_parts_per_publish():
    s = R.publish_stall(STALL_STEPS)
    # per publish: sync_other = 0.030 - 0.023 = 0.007 and 0.040 - 0.033 = 0.007; stall = 0.049 and 0.070
    assert s["drain"] == approx(0.015) and s["engine_reload"] == approx(0.025)
    assert s["sync_other"] == approx(0.007) and s["hooks"] == approx(0.003)
    assert s["stall"] == approx((0.049 + 0.070) / 2)
    assert list(s) == [*R.STALL_PARTS, "stall"]
    assert R.publish_stall([{"step": 1}]) is None
    table = report_render.stall_table({"behav": s, "idle": None})
    assert table[2] == "| behav | 15.0 | 5.0 | 0.0 | 0.0 | 25.0 | 2.0 | 1.0 | 7.0 | 3.0 | 59.5 |"
    assert table[3] == "| idle | no publish |"


def test_dedicated_lag_replaces_its_critical_path_share_on_two_cores():
    lagged = [dict(r, **{"recovery/pending_segments": p, "recovery/lag_s": lag})
              for r, p, lag in zip(STEPS, (9, 4, 2), (5.0, 0.5, 0.25))]
    assert R.scorer_lag(lagged) == {"scorer_pending_segments_median": 3.0, "scorer_lag_s_median": approx(0.375),
                                    "scorer_lag_s_max": 0.5}  # steps 2..3
    assert R.scorer_lag(STEPS) is None
    load = {"loadavg_start": 1.0, "loadavg_end": 1.0}
    two = R.build_report({"dedicated": _run(lagged)}, None, meta={"cpu_count": 2, **load})
    assert two["strategies"]["dedicated"]["critical_path_overhead_frac"] is None
    assert two["strategies"]["dedicated"]["scorer_lag_s_max"] == 0.5
    assert two["targets"][2]["passed"] is None  # the 5% target is not judged on a share that measures contention
    md = report_render.render_markdown(two)
    assert "On 2 CPUs the dedicated scorer has no core of its own" in md
    assert "| dedicated | 3 | 0.375 | 0.500 |" in md
    four = R.build_report({"dedicated": _run(lagged)}, None, meta={"cpu_count": 4, **load})
    assert four["strategies"]["dedicated"]["critical_path_overhead_frac"] == approx((0.37 + 0.11) / (1.29 + 0.85))
    assert "has no core of its own" not in report_render.render_markdown(four)
