"""Interleaved, repeated timing runs and their intervals (megarl/bench/interleave.py) on a simulated machine.

The machine runs each strategy's steps on a clock; from a set time on, a CPU burner slows every CPU-bound
second by ``factor`` (the batch waits keep their length). The burner starts halfway through the schedule,
inside a run. Run one after another (A A A B B B), every repeat of B is loaded and none of A: the ratio
moves and its interval, narrow because the repeats agree, misses the quiet machine's value. Interleaved
(A B, B A, A B), the per-round ratios keep the quiet value but for the round the burner starts in, and the
interval covers it.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from megarl.bench import interleave

#: seconds per step of each strategy on the quiet machine: its own work, the trainer's step, the batch wait
BASE = {"behav": (0.0, 0.70, 0.10), "recompute": (0.30, 0.70, 0.10), "ewma": (0.12, 0.70, 0.10),
        "snapshot": (0.40, 0.70, 0.10), "interrupt_sync": (0.41, 0.70, 0.10),
        # --compare-sync's behav runs: the synchronous one waits for every batch
        "async": (0.0, 0.70, 0.10), "sync": (0.0, 0.70, 0.60)}
STEPS = 5
START_S = 6.0  # process start, engine reset: before step 1
FIRST_STEP_S = 3.0  # the first step's start-up (not counted: the medians skip step 1)


class Machine:
    """Runs a strategy's steps on a clock; from ``burst_at`` on, CPU seconds take ``factor`` times longer."""

    def __init__(self, burst_at: float = float("inf"), factor: float = 1.8, noise: float = 0.03, seed: int = 0):
        self.clock, self.burst_at, self.factor, self.noise = 0.0, burst_at, factor, noise
        self.rng = random.Random(seed)

    def run(self, name: str, steps: int = STEPS) -> list[dict]:
        own, train, wait = BASE[name]
        self.clock += START_S
        records, wall = [], 0.0
        for i in range(1, steps + 1):
            slow = (self.factor if self.clock >= self.burst_at else 1.0) * (1 + self.rng.uniform(-self.noise,
                                                                                                  self.noise))
            step = wait + (own + train) * slow + (FIRST_STEP_S if i == 1 else 0.0)
            self.clock += step
            wall += step
            records.append({"step": i, "step_s": step, "wall_s": wall, "wait_batch_s": wait,
                            "recovery_s": own * slow, "train_step_s": train * slow, "tokens": 100})
        return records


def _median_step(records: list[dict]) -> float:
    from megarl.bench.report import summarize

    return summarize(records, 0, 0.0, verified=False)["step_time_s_median"]


def _ratio(order: list[tuple[int, str]], machine: Machine, a: str, b: str, repeats: int) -> dict:
    steps = {(r, n): _median_step(machine.run(n)) for r, n in order}
    return interleave.ratio_interval([steps[(r, a)] for r in range(repeats)], [steps[(r, b)] for r in range(repeats)])


def _sequential(names: list[str], repeats: int) -> list[tuple[int, str]]:
    return [(r, n) for n in names for r in range(repeats)]


def _quiet_and_burst_at(order: list[tuple[int, str]], a: str, b: str, repeats: int) -> tuple[float, float]:
    """The quiet machine's ratio (no noise, no burner) and half of its schedule's length."""
    quiet = Machine(noise=0.0)
    value = _ratio(order, quiet, a, b, repeats)["ratio"]
    return value, quiet.clock / 2


def test_the_schedule_runs_every_strategy_once_a_round_and_reverses_every_other_round():
    assert interleave.schedule(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                       (2, "a"), (2, "b"), (2, "c")]
    assert interleave.schedule(["a"], 1) == [(0, "a")]
    with pytest.raises(ValueError, match="repeats=0"):
        interleave.schedule(["a"], 0)


def test_a_burner_started_halfway_moves_the_sequential_ratio_and_not_the_interleaved_one():
    names, a, b, repeats = ["recompute", "ewma"], "ewma", "recompute", 3
    covered = {"interleaved": 0, "sequential": 0}
    for seed in range(50):
        for kind, order in (("interleaved", interleave.schedule(names, repeats)),
                            ("sequential", _sequential(names, repeats))):
            quiet, half = _quiet_and_burst_at(order, a, b, repeats)
            machine = Machine(burst_at=half, seed=seed)
            r = _ratio(order, machine, a, b, repeats)
            assert machine.clock > half > 0  # the burner did start, inside the schedule
            covered[kind] += interleave.holds(r, quiet)
    # the nominal level is 90%; the round the burner starts in widens the interval rather than moving it
    assert covered["interleaved"] >= 43, covered
    assert covered["sequential"] <= 2, covered


def test_one_seed_in_detail_sequential_misses_interleaved_covers():
    names, a, b, repeats = ["recompute", "ewma"], "ewma", "recompute", 3
    quiet, half = _quiet_and_burst_at(interleave.schedule(names, repeats), a, b, repeats)
    assert quiet == pytest.approx(0.92 / 1.10)
    inter = _ratio(interleave.schedule(names, repeats), Machine(burst_at=half, seed=1), a, b, repeats)
    seq_quiet, seq_half = _quiet_and_burst_at(_sequential(names, repeats), a, b, repeats)
    seq = _ratio(_sequential(names, repeats), Machine(burst_at=seq_half, seed=1), a, b, repeats)
    assert seq_quiet == pytest.approx(quiet)
    assert inter["low"] <= quiet <= inter["high"], inter
    assert seq["low"] > quiet * 1.5, seq  # every ewma run loaded, no recompute run: 1.8x, a narrow interval
    assert inter["n"] == seq["n"] == 3 and len(inter["per_repeat"]) == 3


def test_intervals_by_hand():
    # log ratios ln 2, ln 2, ln 0.5: mean ln2/3, sd = ln2 * sqrt(4/3)
    r = interleave.ratio_interval([2.0, 4.0, 1.0], [1.0, 2.0, 2.0])
    assert r["ratio"] == pytest.approx(2 ** (1 / 3)) and r["per_repeat"] == [2.0, 2.0, 0.5]
    import math

    half = 2.919985580 * math.log(2) * math.sqrt(4 / 3) / math.sqrt(3)  # t_{0.95, 2}
    assert math.log(r["low"]) == pytest.approx(math.log(2) / 3 - half, rel=1e-6)
    assert math.log(r["high"]) == pytest.approx(math.log(2) / 3 + half, rel=1e-6)
    one = interleave.ratio_interval([2.0], [1.0])
    assert one["ratio"] == 2.0 and one["low"] is None and not interleave.holds(one, 2.0)
    assert interleave.ratio_interval([1.0, 0.0], [1.0, 1.0]) is None  # a step of 0 s: no ratio
    s = interleave.share_interval([0.1, 0.3], [1.0, 1.0])
    assert s["share"] == pytest.approx(0.2) and s["low"] < 0.2 < s["high"]
    assert interleave.ratio_text(r).startswith(f"{r['ratio']:.3f} [")


def _fake_run(machine: Machine, calls: list[str]):
    """Stands in for megarl/bench/run.py's run_strategy: the machine's records, no process."""
    def run(spec: dict, pool=None) -> dict:
        calls.append(spec["run_dir"])
        eta = [o for o in spec["overrides"] if o.startswith("rollout.eta=")]
        kind = spec["strategy"] if not eta else "sync" if eta[-1] == "rollout.eta=0" else "async"
        recs = machine.run(kind, spec["steps"])
        return {"records": recs, "weights_nbytes": 10, "child": {"peak_rss_mb": 100.0, "total_s": recs[-1]["wall_s"]}}
    return run


class _NoEngines:
    def __init__(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_bench_interleaves_repeats_and_reports_the_ratio_with_its_interval(tmp_path, monkeypatch):
    from megarl.bench import run as bench_run

    names = ["recompute", "ewma"]
    quiet, half = _quiet_and_burst_at(interleave.schedule(names, 3), "ewma", "recompute", 3)
    calls: list[str] = []
    monkeypatch.setattr(bench_run, "run_strategy", _fake_run(Machine(burst_at=half, seed=3), calls))
    monkeypatch.setattr(bench_run, "EnginePool", _NoEngines)
    rep = bench_run.bench("configs/bench_cpu.yaml", names, STEPS, str(tmp_path), [], verify=False, repeats=3,
                          log=lambda s: None)
    out = Path(tmp_path)
    assert calls == [str(out / "recompute"), str(out / "ewma"), str(out / "repeats" / "ewma_2"),
                     str(out / "repeats" / "recompute_2"), str(out / "repeats" / "recompute_3"),
                     str(out / "repeats" / "ewma_3")]
    (ratio,) = rep["ratios"]
    assert (ratio["of"], ratio["to"], ratio["n"]) == ("ewma", "recompute", 3)
    assert ratio["low"] <= quiet <= ratio["high"], ratio
    target = rep["targets"][0]
    assert target["target"] == "ewma step time / recompute step time" and target["value"] == ratio["ratio"]
    assert (target["low"], target["high"]) == (ratio["low"], ratio["high"])
    md = (out / "report.md").read_text()
    assert "3 runs each, interleaved" in md and "## Step time ratios" in md
    assert f"- ewma / recompute: {interleave.ratio_text(ratio)} (per repeat: " in md
    assert rep["meta"]["repeats"] == 3


def test_a_target_whose_interval_holds_its_bound_is_open():
    t = {"target": "x", "value": 1.02, "op": "<=", "bound": 1.05, "passed": True, "low": 0.95, "high": 1.10, "n": 3,
         "resolved": False}
    assert interleave.target_cells(t) == ("OPEN", "1.020 [0.950, 1.100] over 3 repeats, the interval holds the bound")
    assert interleave.target_cells({**t, "low": 0.99, "high": 1.04, "resolved": True})[0] == "PASS"
    assert interleave.target_cells({**t, "value": None, "passed": None}) == ("SKIP", "not measured")


def test_repeats_that_cannot_apply_get_one_error_naming_the_flag():
    from megarl.cli import build_parser
    from megarl.errors import ConfigError

    def run(*argv):
        args = build_parser(only="bench").parse_args(["bench", *argv])
        return args.func(args)

    with pytest.raises(ConfigError, match="--repeats 0: give at least 1"):
        run("--strategies", "behav", "--repeats", "0", "--output", "o")
    with pytest.raises(ConfigError, match="--quality and --packing do not take it"):
        run("--quality", "--repeats", "2", "--output", "o")


def test_compare_sync_alternates_async_and_sync_per_core_layout_and_reports_each_ratio_with_its_interval(
        tmp_path, monkeypatch):
    from megarl.bench import report_render
    from megarl.bench import run as bench_run

    calls: list[str] = []
    monkeypatch.setattr(bench_run, "run_strategy", _fake_run(Machine(seed=4), calls))
    monkeypatch.setattr(bench_run, "EnginePool", _NoEngines)
    rep = bench_run.bench("configs/bench_cpu.yaml", [], STEPS, str(tmp_path), [], compare_sync=True, eta=2,
                          disjoint_cores="0:1", repeats=3, log=lambda s: None)
    names = [c.removeprefix(str(tmp_path) + "/") for c in calls]
    assert names == ["async_eta2", "sync_eta0", "repeats/sync_eta0_2", "repeats/async_eta2_2",
                     "repeats/async_eta2_3", "repeats/sync_eta0_3",
                     "async_eta2_disjoint", "sync_eta0_disjoint", "repeats/sync_eta0_disjoint_2",
                     "repeats/async_eta2_disjoint_2", "repeats/async_eta2_disjoint_3", "repeats/sync_eta0_disjoint_3"]
    avs = rep["async_vs_sync"]
    for key in ("throughput_ratio", "throughput_ratio_disjoint_cores"):
        r = avs[f"{key}_interval"]  # a step of 1.30 s synchronous against 0.80 s asynchronous, +-3% CPU seconds
        assert r["n"] == 3 and r["low"] <= avs[key] == r["ratio"] <= r["high"], r
        assert abs(r["ratio"] - 1.30 / 0.80) < 0.08, r
    by_name = {t["target"]: t for t in rep["targets"]}
    t = by_name["async / sync throughput (tokens/s)"]
    assert (t["low"], t["high"], t["n"]) == (avs["throughput_ratio_interval"]["low"],
                                            avs["throughput_ratio_interval"]["high"], 3)
    assert t["passed"] is False and t["resolved"] is True  # 1.6 against a target of 2, the interval below it
    md = (tmp_path / "report.md").read_text()
    assert f"ratio {interleave.throughput_text(avs, 'throughput_ratio')}" in md and "over 3 repeats" in md
    assert report_render.target_lines(rep)[4].startswith("FAIL  async / sync throughput (tokens/s): 1.6")
