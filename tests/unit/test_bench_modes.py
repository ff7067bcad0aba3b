"""The bench's modes on hand-made records: --compare-sync's runs, the fits, the sweep's rows, growth verdicts
and report, the quality curves and table (hand-computed numbers)."""
import json
import math

import pytest

from megarl.bench import quality, sweep
from megarl.bench.compare_sync import split_cores, sync_runs
from megarl.bench.fit import nonneg_lstsq, power_law
from megarl.bench.run import _prepare_run_dir
from megarl.errors import ConfigError, MegarlError


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
    assert quality.final_window_reward(seeds[0], 2) == approx(0.5)
    (row,) = quality.final_table({("behav", 8): seeds}, window=2)
    # per seed: (0.4+0.6)/2 = 0.5, (0.2+0.9)/2 = 0.55; mean 0.525, sample std 0.0354
    assert row["per_seed"] == approx([0.5, 0.55]) and row["mean"] == approx(0.525)
    assert row["std"] == approx(math.sqrt(2 * 0.025 ** 2)) and row["wall_s_median"] == approx(9.0)
    rep = quality.build_quality_report({("behav", 8): seeds}, window=2, smooth=2,
                                       meta={"config": "q.yaml", "steps": 4, "seeds": [0, 1]})
    json.dumps(rep, allow_nan=False)
    md = quality.render_quality_markdown(rep)
    assert "| behav | 8 | 0.5250 | 0.0354 | 0.5000, 0.5500 | 9.0 |" in md


def test_prepare_run_dir_removes_a_run_stopped_before_its_config(tmp_path):
    d = tmp_path / "cell"
    d.mkdir()
    (d / "bench.log").write_text("starting\n")  # run_child's first file; train() had not written config.yaml
    _prepare_run_dir(d)
    assert d.is_dir() and list(d.iterdir()) == []
    (d / "notes.txt").write_text("mine\n")
    with pytest.raises(MegarlError, match="is not a previous bench run"):
        _prepare_run_dir(d)
