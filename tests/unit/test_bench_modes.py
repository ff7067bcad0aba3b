"""The bench's modes on hand-made records: --compare-sync's runs, the fits, the sweep's rows, growth verdicts
and report, the quality curves, table, statistics, strategy variants and resumed grids (hand-computed numbers)."""
import json
import math
from pathlib import Path

import pytest

from megarl.bench import quality, quality_runs, quality_stats, report, sweep, variants
from megarl.bench.compare_sync import split_cores, sync_runs
from megarl.bench.run import _prepare_run_dir
from megarl.errors import ConfigError, MegarlError
from megarl.launch.fit import nonneg_lstsq, power_law


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


# -- compare-sync --------------------------------------------------------------------------------
def test_split_cores_default_halves_and_spec():
    assert split_cores(None, {0, 1}) == ([0], [1])
    assert split_cores(None, {0, 1, 2}) == ([0], [1, 2])
    assert split_cores(None, {4, 5, 6, 7}) == ([4, 5], [6, 7])
    assert split_cores("0-1:2-3", {0, 1, 2, 3}) == ([0, 1], [2, 3])
    with pytest.raises(ConfigError, match=r"--disjoint-cores='0:0-1': core\(s\) 0 are given to both roles"):
        split_cores("0:0-1", {0, 1})
    with pytest.raises(ConfigError, match=r"write TRAINER:ENGINES, e\.g\. 0:1"):
        split_cores("0", {0, 1})
    with pytest.raises(ConfigError, match=r"core\(s\) 5 are not available"):
        split_cores("0:5", {0, 1})
    with pytest.raises(ConfigError, match="needs at least 2 cores"):
        split_cores(None, {3})


def test_the_four_sync_runs():
    runs = sync_runs(4, [0], [1])
    assert [(k, d) for k, d, _ in runs] == [("async", "async_eta4"), ("sync", "sync_eta0"),
                                            ("async_disjoint", "async_eta4_disjoint"),
                                            ("sync_disjoint", "sync_eta0_disjoint")]
    assert runs[2][2] == ["rollout.eta=4", "placement.cpu_affinity.trainer=[0]", "placement.cpu_affinity.engines=[1]"]
    assert runs[1][2] == ["rollout.eta=0", "trainer.publish_every=1"]
    with pytest.raises(ConfigError, match="give an eta >= 1"):
        sync_runs(0, [0], [1])


# -- fits ----------------------------------------------------------------------------------------
def test_power_law_fit():
    f = power_law([1, 2, 4], [3, 6, 12])
    assert f["exponent"] == approx(1.0) and f["coef"] == approx(3.0) and f["r2"] == approx(1.0) and f["n"] == 3
    g = power_law([1, 4, 0], [2, 1, 5])  # x = 0 is dropped: y = 2 x^-0.5
    assert g["exponent"] == approx(-0.5) and g["coef"] == approx(2.0) and g["n"] == 2
    assert power_law([2, 2], [1, 3]) is None and power_law([1, 2], [0, 0]) is None
    flat = power_law([1, 2, 4], [5, 5, 5])
    assert flat["exponent"] == approx(0.0) and flat["r2"] == 0.0


def test_nonneg_least_squares():
    assert nonneg_lstsq([[1, 1], [1, 2], [1, 3]], [2, 3, 4]) == [approx(1.0), approx(1.0)]
    # unconstrained: 4 - 1 x; the negative slope is dropped and the intercept refitted to the mean, 2
    assert nonneg_lstsq([[1, 1], [1, 2], [1, 3]], [3, 2, 1]) == [approx(2.0), 0.0]


# -- sweep ---------------------------------------------------------------------------------------
W = 1000  # bytes of one set of weights


def _records(recovery, held, lags, stall=0.02):
    """Three steps: recovery seconds and bytes held, version lags per step (the batch's version_lag_hist)."""
    out = []
    for i, hist in enumerate(lags):
        r = {"step": i + 1, "step_s": 1.0, "wall_s": float(i + 1), "recovery_s": recovery, "tokens": 10,
             "recovery/bytes_held": held, "version_lag_hist": hist, "recovery/bench_seq_tokens": 100.0 * (i + 1),
             "recovery/bench_version_seq_tokens": 150.0 * (i + 1)}
        if i < len(lags) - 1:
            r.update(publish_s=stall, publish_stall_s=stall, weight_sync_s=stall)
        out.append(r)
    return out


def test_sweep_row_hand_computed():
    rec = _records(0.01, 2 * W, [{"0": 4}, {"0": 2, "1": 2}, {"0": 1, "1": 1, "2": 2}])
    row = sweep.sweep_row(rec, W)
    assert row["recovery_s_median"] == approx(0.01) and row["extra_bytes_held"] == 2 * W
    assert row["distinct_versions_mean"] == approx(2.5) and row["distinct_versions_max"] == 3  # steps 2..3: 2, 3
    assert row["stale_versions_mean"] == approx(1.5)  # lag > 0: 1 and 2
    assert row["seq_tokens_mean"] == approx(250.0) and row["version_seq_tokens_mean"] == approx(375.0)
    assert row["stall_per_publish_s"] == approx(0.02) and row["bytes_moved_per_step"] == approx(2 * W / 3)
    # a copy held by another process (dedicated) counts one set of weights per copy
    ded = [dict(r, **{"recovery/bytes_held": 0.0, "recovery/extra_param_copies": 1.0}) for r in rec]
    assert sweep.sweep_row(ded, W)["extra_bytes_held"] == W


def _row(model, params, eta, strategy, recovery, held, versions, stall=0.02):
    return {"model": model, "params": params, "eta": eta, "strategy": strategy, "recovery_s_median": recovery,
            "extra_bytes_held": held, "stall_per_publish_s": stall, "distinct_versions_mean": versions,
            "weights_nbytes": W}


ROWS = [
    # snapshot: recovery ~ params * versions, holds eta + 1 sets of weights
    _row("a", 1e5, 1, "snapshot", 0.010, 2 * W, 2), _row("a", 1e5, 8, "snapshot", 0.045, 9 * W, 9),
    _row("b", 1e6, 1, "snapshot", 0.100, 2 * W, 2), _row("b", 1e6, 8, "snapshot", 0.450, 9 * W, 9),
    # recompute: one forward whatever eta
    _row("a", 1e5, 1, "recompute", 0.010, 0, 2), _row("a", 1e5, 8, "recompute", 0.011, 0, 9),
    _row("b", 1e6, 1, "recompute", 0.100, 0, 2), _row("b", 1e6, 8, "recompute", 0.104, 0, 9),
    # behav: no forward; 0.1 ms -> 0.5 ms is 5x but below the noise floor
    _row("a", 1e5, 1, "behav", 0.0001, 0, 2), _row("a", 1e5, 8, "behav", 0.0005, 0, 9),
]


def test_growth_verdicts():
    g = sweep.growth(ROWS)
    assert g["snapshot"]["grows_with_eta"] and g["snapshot"]["recovery_s_median"]["grows"]
    assert g["snapshot"]["extra_bytes_held"]["ratio_by_model"] == {"a": approx(4.5), "b": approx(4.5)}
    assert not g["recompute"]["grows_with_eta"]
    assert g["recompute"]["recovery_s_median"]["ratio_by_model"] == {"a": approx(1.1), "b": approx(1.04)}
    assert not g["behav"]["grows_with_eta"] and g["behav"]["recovery_s_median"]["ratio_by_model"]["a"] == approx(5)
    assert g["behav"]["extra_bytes_held"]["ratio_by_model"] == {"a": None}  # 0 -> 0


def test_fits_per_strategy():
    f = sweep.fits(ROWS)
    # snapshot at eta 1: 0.01 at 1e5, 0.1 at 1e6 -> exponent 1
    assert f["snapshot"]["recovery_vs_params"]["1"]["exponent"] == approx(1.0)
    # vs versions per model: 0.010 at 2, 0.045 at 9 -> exponent log(4.5)/log(4.5) = 1
    assert f["snapshot"]["recovery_vs_versions"]["a"]["exponent"] == approx(1.0)
    assert f["recompute"]["recovery_vs_versions"]["b"]["exponent"] == approx(math.log(1.04) / math.log(4.5))
    assert f["behav"]["recovery_vs_params"]["1"] is None  # one model only


def test_sweep_report_renders():
    rows = [dict(r, active_params=r["params"], moe=False, step_time_s_median=0.5, bytes_moved_per_step=2.0 * W,
                 stall_parts_s=None) for r in ROWS]
    rep = sweep.build_sweep_report(rows, {"config": "c.yaml", "steps": 3, "cpu_count": 2})
    json.dumps(rep, allow_nan=False)
    md = sweep.render_sweep_markdown(rep)
    assert "| a | 0.10M | 8 | snapshot | 0.5000 | 0.0450 | 0.01 | 0.00 | 20.0 | 9.00 |" in md
    assert "Costs that grow with eta: snapshot. Flat: recompute, behav." in md
    assert "| snapshot | yes | grows (a 4.50x, b 4.50x) |" in md


def test_sweep_grid_and_estimate():
    infos = [sweep.model_info(sweep.resolve_model(m)) for m in sweep.DEFAULT_MODELS]
    sizes = [i["params"] for i in infos]
    assert max(sizes) / min(sizes) >= 16 and any(i["moe"] for i in infos) and not all(i["moe"] for i in infos)
    assert infos[0] == {"model": "tiny_qwen3", "yaml": infos[0]["yaml"], "params": 132672, "active_params": 132672,
                        "moe": False}
    grid = sweep.cells(infos[:2], [1, 8], ["behav", "snapshot"])
    assert len(grid) == 8 and grid[0][1:] == (1, "behav")
    a, b = sweep.ESTIMATE_STEP_S
    assert sweep.estimate_seconds(grid, 10) == approx(
        8 * sweep.ESTIMATE_STARTUP_S + 4 * 10 * (a + b * 132672) + 4 * 10 * (a + b * infos[1]["active_params"]))
    with pytest.raises(ConfigError, match="neither a model YAML nor a name under configs/models/"):
        sweep.resolve_model("tiny_qwen9")
    with pytest.raises(ConfigError, match="give etas >= 1"):
        sweep.cells(infos[:1], [0], ["behav"])


# -- quality -------------------------------------------------------------------------------------
def _run(rewards):
    return [{"step": i + 1, "reward_mean": r, "wall_s": 2.0 * (i + 1), "step_s": 2.0} for i, r in enumerate(rewards)]


def test_quality_curves_and_final_window():
    seeds = [_run([0.0, 0.2, 0.4, 0.6]), _run([0.2, 0.2, 0.2, 0.2, 0.9])]  # the second ran one step more
    c = quality.curve(seeds, smooth=2)
    # smoothed: [0, .1, .3, .5] and [.2, .2, .2, .2]; four common steps
    assert c["step"] == [1, 2, 3, 4] and c["wall_s"] == approx([2.0, 4.0, 6.0, 8.0])
    assert c["mean"] == approx([0.1, 0.15, 0.25, 0.35])
    assert c["low"] == approx([0.0, 0.1, 0.2, 0.2]) and c["high"] == approx([0.2, 0.2, 0.3, 0.5])
    assert quality_runs.final_window_reward(seeds[0], 2) == approx(0.5)
    (row,) = quality.final_table({("behav", 8): seeds}, window=2)
    # per seed: (0.4+0.6)/2 = 0.5, (0.2+0.9)/2 = 0.55; mean 0.525, sample std 0.0354
    assert row["per_seed"] == approx([0.5, 0.55]) and row["mean"] == approx(0.525)
    assert row["std"] == approx(math.sqrt(2 * 0.025 ** 2)) and row["wall_s_median"] == approx(9.0)
    rep = quality.build_quality_report({("behav", 8): seeds}, window=2, smooth=2,
                                       meta={"config": "q.yaml", "steps": 4, "seeds": [0, 1]})
    json.dumps(rep, allow_nan=False)
    md = quality.render_quality_markdown(rep)
    assert "| behav | 8 | 0.5250 | 0.0354 | 0.5000, 0.5500 | 9.0 |" in md


def test_steps_to_threshold_and_its_summary_over_seeds():
    assert quality_stats.steps_to_threshold([0.1, 0.3, 0.5, 0.4], 0.5) == 3  # reaching it exactly counts
    assert quality_stats.steps_to_threshold([0.1, 0.3, 0.5, 0.4], 0.6) is None
    s = quality_stats.threshold_summary([3, None, 5])  # median of 3, 5, never: 5
    assert s == {"per_seed": [3, None, 5], "reached": 2, "of": 3, "median": 5.0, "mean": 4.0}
    s = quality_stats.threshold_summary([3, None, None])  # the median seed never got there
    assert s["median"] is None and s["mean"] == 3.0 and s["reached"] == 1
    assert quality_stats.threshold_summary([None, None])["mean"] is None
    # through the table: smoothed (2 steps) rewards [0, .1, .3, .5] and [.2, .2, .2, .2]
    seeds = [_run([0.0, 0.2, 0.4, 0.6]), _run([0.2, 0.2, 0.2, 0.2])]
    (row,) = quality.final_table({("behav", 1): seeds}, window=2, smooth=2, threshold=0.25)
    assert row["steps_to_threshold"]["per_seed"] == [3, None]
    # default threshold: half the best mean final-window reward, (0.5 + 0.2) / 2 / 2 = 0.175 -> steps 3 and 1
    (row,) = quality.final_table({("behav", 1): seeds}, window=2, smooth=2)
    assert row["steps_to_threshold"]["per_seed"] == [3, 1] and row["steps_to_threshold"]["median"] == 2.0


def test_difference_interval_constant_cells_have_zero_width():
    # both cells constant: the interval shrinks to the difference of the means, paired or Welch
    iv = quality_stats.diff_interval({0: 0.3, 1: 0.3, 2: 0.3}, {0: 0.1, 1: 0.1})  # seeds differ: Welch
    assert iv["method"] == "Welch t" and (iv["n_a"], iv["n_b"]) == (3, 2)
    assert iv["diff"] == approx(0.2) and iv["low"] == approx(0.2) and iv["high"] == approx(0.2)
    assert iv["verdict"] == "above behav"
    iv = quality_stats.diff_interval({0: 0.3, 1: 0.3}, {1: 0.1, 0: 0.1})  # same seeds: paired
    assert iv["method"] == "paired t" and iv["n"] == 2 and iv["low"] == approx(0.2) == iv["high"]
    assert quality_stats.diff_interval({0: 0.3}, {0: 0.1, 1: 0.2}) is None  # one seed: no interval
    assert quality_stats.diff_interval({0: 0.3}, {0: 0.1}) is None  # one pair: no interval


def _diag_run(rewards, active, masked, r_d=None, gap=0.01):
    recs = _run(rewards)
    for i, r in enumerate(recs):
        r.update({"active_frac": active[i], "behav_w/masked_frac": masked[i],
                  "abs_logp_anchor_minus_behav_mean": gap, "behav_w/downweighted_frac": 0.0})
        if r_d is not None:
            r["r_d/abs_logp_mean"] = r_d[i]
    return recs


def test_cell_diagnostics_r_d_active_and_masked_share():
    a = _diag_run([0.1, 0.2, 0.3], [1.0, 0.5, 0.8], [0.0, 0.5, 0.2], r_d=[0.1, 0.3, 0.2], gap=0.02)
    b = _diag_run([0.1, 0.2, 0.3, 0.4], [1.0, 0.7, 0.6, 0.1], [0.0, 0.3, 0.4, 0.9])  # a step more; no r_d
    d = quality_stats.cell_diagnostics([a, b], 3)
    assert d["active_frac_curve"] == approx([1.0, 0.6, 0.7]) and d["active_frac_min"] == approx(0.6)
    assert d["active_frac_min_any_seed"] == approx(0.1)  # every logged step counts here, also b's fourth
    assert d["r_d_abs_logp_mean"] == approx(0.2)  # only a logged it
    assert d["abs_logp_anchor_minus_behav_mean"] == approx((3 * 0.02 + 4 * 0.01) / 7)
    assert d["masked_frac_mean"] == approx(2.3 / 7) and d["masked_frac_max"] == approx(0.9)
    assert d["ewma_active_frac_pre_min"] is None and d["downweighted_frac_mean"] == 0.0


def test_quality_report_differences_to_behav():
    behav = [_diag_run([0.1, 0.2], [1, 1], [0, 0]), _diag_run([0.3, 0.4], [1, 1], [0, 0])]  # final (w=1) .2, .4
    ewma = [_diag_run([0.5, 0.5], [1, 0.5], [0, 0.5], r_d=[0.1, 0.1]),
            _diag_run([0.5, 0.8], [1, 0.5], [0, 0.5], r_d=[0.1, 0.3])]  # final .5, .8
    cells = {("behav", 8): behav, ("ewma(auto_reset=false)", 8): ewma, ("ewma(auto_reset=false)", 1): ewma}
    rep = quality.build_quality_report(cells, window=1, smooth=1, meta={"config": "q.yaml", "steps": 2})
    json.dumps(rep, allow_nan=False)
    (d,) = rep["quality"]["vs_behav"]  # eta 1 has no behav: no difference
    assert (d["strategy"], d["eta"], d["diff"]) == ("ewma(auto_reset=false)", 8, approx(0.35))
    # seeds 0 and 1 in both cells: paired, differences .3 and .4, sd 0.1/sqrt(2), se 0.05, t(0.95, 1) = 6.313752
    iv = d["interval"]
    assert (iv["method"], iv["n"], iv["df"]) == ("paired t", 2, 1.0) and iv["se"] == approx(0.05)
    assert (iv["low"], iv["high"]) == (pytest.approx(0.35 - 0.3156876, abs=1e-6), pytest.approx(0.6656876, abs=1e-6))
    assert d["verdict"] == "not called at n < 5"  # the interval excludes 0, but 2 seeds a side call nothing
    assert rep["quality"]["threshold"] == approx(0.325)  # half of ewma's 0.65
    assert rep["quality"]["curves"][1]["active_frac"] == approx([1.0, 0.5])
    md = quality.render_quality_markdown(rep)
    assert ("| ewma(auto_reset=false) | 8 | +0.3500 | [+0.0343, +0.6657] | 2 pairs | paired t | 1.0 | not called at "
            "n < 5 |" in md)
    assert "| behav | 8 | not logged (inexact anchor) | 1.00e-02 | 1.0000 | 1.0000 | 0.0000 | 0.0000 |" in md
    assert "| ewma(auto_reset=false) | 8 | 1.50e-01 | 1.00e-02 | 0.5000 | 0.5000 | 0.2500 | 0.0000 |" in md
    # steps to 0.325 with no smoothing: behav seeds never / 2, ewma 1 and 1
    assert "| behav | 8 | 1/2 | not reached | 2.0 | not reached, 2 |" in md


def test_quality_report_welch_and_too_few_seeds():
    """Cells whose seed sets differ from behav's get Welch's interval; a cell with one seed gets none."""
    behav = [_run([0.0, x]) for x in (1.0, 2.0, 3.0)]  # final (w=1): 1, 2, 3
    other = [_run([0.0, x]) for x in (0.5, 1.5, 2.5)]  # 0.5, 1.5, 2.5
    cells = {("behav", 8): behav, ("snapshot", 8): other, ("ewma", 8): other[:1]}
    rep = quality.build_quality_report(cells, window=1, smooth=1, meta={},
                                       seeds={("behav", 8): [0, 1, 2], ("snapshot", 8): [0, 1, 3], ("ewma", 8): [0]})
    welch, few = rep["quality"]["vs_behav"]
    # equal n (3) and variances (1): Welch-Satterthwaite df = 2 (n - 1) = 4, se = sqrt(2/3) = 0.816497,
    # t(0.95, 4) = 2.131847: half-width 1.740646
    iv = welch["interval"]
    assert (iv["method"], iv["n_a"], iv["n_b"], iv["n"]) == ("Welch t", 3, 3, None) and iv["df"] == approx(4.0)
    assert iv["low"] == pytest.approx(-0.5 - 1.740646, abs=1e-6) and iv["high"] == pytest.approx(1.240646, abs=1e-6)
    assert welch["verdict"] == "not called at n < 5"
    assert few["interval"] is None and few["verdict"] == "n too small" and few["diff"] == approx(-1.5)
    md = quality.render_quality_markdown(rep)
    assert "| snapshot | 8 | -0.5000 | [-2.2406, +1.2406] | 3 vs 3 | Welch t | 4.0 | not called at n < 5 |" in md
    assert "| ewma | 8 | -1.5000 | n too small | 1 vs 3 | - | - | n too small |" in md
    assert "| behav | 8 | 2.0000 | 1.0000 | 1.0000, 2.0000, 3.0000 | 4.0 | 0, 1, 2 |" in md


# -- quality: strategy variants ------------------------------------------------------------------
QCFG = "configs/bench_quality_cpu.yaml"
NAMES = ["behav", "ewma", "snapshot"]


def test_variant_parser_labels_dirs_and_overrides():
    checked = []
    vs = variants.parse_strategies("behav, ewma:auto_reset=false,ewma:tau=0.3;auto_reset=true", checked.append,
                                   NAMES)
    assert [v.label for v in vs] == ["behav", "ewma(auto_reset=false)", "ewma(tau=0.3, auto_reset=true)"]
    assert [v.dirname for v in vs] == ["behav", "ewma-auto_reset-false", "ewma-tau-0.3-auto_reset-true"]
    assert checked[1] == ["recovery.name=ewma", "recovery.ewma.auto_reset=false"]
    assert vs[2].overrides() == ["recovery.ewma.tau=0.3", "recovery.ewma.auto_reset=true"]
    assert [v.label for v in variants.parse_strategies("all", checked.append, NAMES)] == NAMES
    assert variants.parse_strategies("none", checked.append, NAMES) == []
    assert variants.Variant("ewma", (("x", "a/b c"),)).dirname == "ewma-x-a_b_c"


@pytest.mark.parametrize("spec, message", [
    ("ewma:auto_reset", r"option 'auto_reset' is not key=value; options are separated by ';'"),
    ("ewma:", "has no option after ':'"),
    (":tau=1", "has no strategy name"),
    ("ewma:tau=1;tau=2", "sets tau twice"),
    ("ewma,behav,ewma", r"'ewma' and 'ewma' are the same run \(label 'ewma'\)"),
    ("ewma:x=a/b,ewma:x=a_b", r"'ewma\(x=a/b\)' and 'ewma\(x=a_b\)' are the same run \(dirname 'ewma-x-a_b'\)"),
    (",", "names no strategy"),
])
def test_variant_parser_syntax_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        variants.parse_strategies(spec, lambda extra: None, NAMES)


@pytest.mark.parametrize("spec, message", [
    ("behav,ewma:bogus=1", r"--strategies item 'ewma:bogus=1': unknown config key recovery\.ewma\.bogus; "
                           r"valid keys: .*auto_reset"),
    ("ewma:auto_reset=maybe", r"recovery\.ewma\.auto_reset='maybe' has the wrong type: expected bool"),
    ("ewmaa", r"--strategies item 'ewmaa': recovery\.name='ewmaa' is not a recovery strategy; valid: behav"),
])
def test_variant_parser_checks_with_the_config_loader(spec, message):
    from megarl.builder import load_run_config

    with pytest.raises(ConfigError, match=message):
        variants.parse_strategies(spec, lambda extra: load_run_config(QCFG, extra), NAMES)


# -- quality: resuming a grid --------------------------------------------------------------------
class FakeRun:
    """Stands in for run_strategy: records each call, writes the run's metrics.jsonl; stops the grid (as a
    Ctrl-C would) at call number ``stop_at``."""

    def __init__(self, steps, stop_at=None):
        self.steps, self.stop_at, self.calls = steps, stop_at, []

    def __call__(self, spec):
        if len(self.calls) + 1 == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(spec["run_dir"].rsplit("/", 1)[-1])
        seed = int(spec["run_dir"][-1])
        recs = _diag_run([0.1 * seed + 0.01 * s for s in range(self.steps)], [1.0] * self.steps, [0.0] * self.steps)
        run_dir = Path(spec["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return {"records": recs}


def _grid(tmp_path, run, overrides=(), log=None):
    vs = variants.parse_strategies("behav,ewma:auto_reset=false", lambda extra: None, NAMES)
    return quality.run_quality(QCFG, vs, [8], 2, 3, str(tmp_path), list(overrides), run=run, meta={"steps": 3},
                               window=2, log=log or (lambda *_: None))


def test_quality_grid_resumes_after_a_stop(tmp_path):
    first = FakeRun(3, stop_at=3)
    with pytest.raises(KeyboardInterrupt):  # stopped while the third run was going
        _grid(tmp_path, first)
    assert first.calls == ["behav_eta8_seed0", "behav_eta8_seed1"]
    done = json.loads((tmp_path / "runs" / "behav_eta8_seed1" / "done.json").read_text())
    assert done["config"]["recovery"]["name"] == "behav" and done["config"]["trainer"]["seed"] == 1
    lines, again = [], FakeRun(3)
    rep = _grid(tmp_path, again, log=lines.append)
    assert again.calls == ["ewma-auto_reset-false_eta8_seed0", "ewma-auto_reset-false_eta8_seed1"]
    assert lines[0] == f"reusing 2 of 4 runs finished before under {tmp_path / 'runs'}"
    assert lines[1] == f"[1/4] behav eta=8 seed=0: finished before, reused ({tmp_path / 'runs' / 'behav_eta8_seed0'})"
    assert rep["meta"]["reused_runs"] == 2
    done = json.loads((tmp_path / "runs" / "ewma-auto_reset-false_eta8_seed0" / "done.json").read_text())
    assert done["config"]["recovery"]["ewma"]["auto_reset"] is False and done["label"] == "ewma(auto_reset=false)"
    # behav seeds: final window (steps 2, 3) of 0.01, 0.02 and 0.11, 0.12 -> 0.015 and 0.115
    assert rep["quality"]["final"][0]["per_seed"] == approx([0.015, 0.115])

    third = FakeRun(3)
    assert _grid(tmp_path, third)["quality"]["final"] == rep["quality"]["final"] and third.calls == []
    # a run without its done.json (stopped after it logged every step) and one whose metrics lack a step run again
    (tmp_path / "runs" / "behav_eta8_seed0" / "done.json").unlink()
    metrics = tmp_path / "runs" / "behav_eta8_seed1" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    fourth = FakeRun(3)
    _grid(tmp_path, fourth)
    assert fourth.calls == ["behav_eta8_seed0", "behav_eta8_seed1"]
    # another config: nothing is reused
    fifth = FakeRun(3)
    _grid(tmp_path, fifth, overrides=["trainer.lr=1e-3"])
    assert len(fifth.calls) == 4


def test_prepare_run_dir_removes_a_run_stopped_before_its_config(tmp_path):
    d = tmp_path / "cell"
    d.mkdir()
    (d / "bench.log").write_text("starting\n")  # run_child's first file; train() had not written config.yaml
    _prepare_run_dir(d)
    assert d.is_dir() and list(d.iterdir()) == []
    (d / "notes.txt").write_text("mine\n")
    with pytest.raises(MegarlError, match="is not a previous bench run"):
        _prepare_run_dir(d)


class FakeRunWithEval(FakeRun):
    """FakeRun whose metrics.jsonl also holds evaluation records (eval.path set), as a real run writes them."""

    def __call__(self, spec):
        super().__call__(spec)
        metrics = Path(spec["run_dir"]) / "metrics.jsonl"
        seed = int(spec["run_dir"][-1])
        evals = [{"step": s, "eval/pass@1": 0.25 * s + 0.1 * seed, "eval/reward_mean": 0.5} for s in (2, 3)]
        lines = metrics.read_text().splitlines(keepends=True)
        metrics.write_text("".join(lines[:2]) + json.dumps(evals[0]) + "\n" + lines[2] + json.dumps(evals[1]) + "\n")
        return {"records": report.load_metrics(metrics)}


def test_quality_grid_with_evaluation_records(tmp_path):
    """Evaluation lines in metrics.jsonl are neither steps of the reward curve nor a reason to run again; the
    table shows the last evaluation's pass@1."""
    first = FakeRunWithEval(3)
    rep = _grid(tmp_path, first)
    behav = rep["quality"]["final"][0]
    assert behav["per_seed"] == approx([0.015, 0.115])  # as without evaluation records
    assert rep["quality"]["curves"][0]["step"] == [1, 2, 3]
    assert behav["eval_pass1_per_seed"] == approx([0.75, 0.85]) and behav["eval_pass1_mean"] == approx(0.8)
    assert "| behav | 8 | 0.8000 | 0.7500, 0.8500 | 2 |" in quality.render_quality_markdown(rep)
    again = FakeRunWithEval(3)
    assert _grid(tmp_path, again)["quality"]["final"] == rep["quality"]["final"] and again.calls == []
