"""``megarl bench --packing`` without the step-time run: the table's numbers against the plans themselves."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megarl.bench.packing import batches, render, table
from megarl.trainer.packing import DEFAULT_LINEAR_WEIGHT, plan_packing, round_robin_plan, row_workload


def test_the_table_reports_each_plan_as_computed_by_hand():
    rows = table(n_rows=16, n_batches=1, budget=20000, dp_sizes=(4,))
    by = {r["distribution"]: r for r in rows}
    assert set(by) == {"long_tail", "bimodal"}
    lens = batches("long_tail", 16, 1)[0]
    old, new = round_robin_plan(lens, 4, 20000), plan_packing(lens, 4, 20000)
    ideal = sum(row_workload(n, DEFAULT_LINEAR_WEIGHT) for n in lens) / 4
    r = by["long_tail"]
    assert r["before_slowest_over_mean"] == pytest.approx(max(old.workloads(lens)) / ideal)
    assert r["after_slowest_over_mean"] == pytest.approx(max(new.workloads(lens)) / ideal)
    assert r["after_mbs_per_rank"] == len(new.ranks[0]) and r["before_dummies"] == sum(
        1 for mbs in old.ranks for g in mbs if not g)
    assert r["bound"] >= 1.0 and r["after_slowest_over_mean"] >= r["bound"] - 1e-12  # nothing beats the bound
    assert 0 <= r["after_plan_ms"] < 1000 and 0 <= r["thd_plan_ms"] < 1000  # the plan's own CPU time
    text = render(rows, 16, 20000, n_batches=1)
    assert text.count("\n| ") == 3 and "| long_tail | 4 |" in text and "means over 1 batches" in text
    assert "plan time, ms (padded, thd)" in text and f"| {r['after_plan_ms']:.1f}, {r['thd_plan_ms']:.1f} |" in text


def test_the_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "--packing", "--steps", "0",
                          "--packing-rows", "32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "32 rows per batch" in out.stdout and "| bimodal | 64 |" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "--packing", "--packing-rows", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--packing-rows >= 1" in bad.stderr


def test_a_recorded_run_is_a_row_of_the_table(tmp_path):
    import json

    from megarl.bench.packing import recorded_batches, run_packing
    from megarl.errors import ConfigError

    run = tmp_path / "demo_run"
    run.mkdir()
    steps = [{"step": 1, "traj_ids": ["a", "b", "c"], "n_tokens": [10, 30, 20]},
             {"step": 2, "traj_ids": [], "skipped": True},  # trained nothing: no batch
             {"step": 3, "traj_ids": ["d", "e"], "n_tokens": [40, 5]}]
    (run / "trained_ids.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert recorded_batches(run) == [[10, 30, 20], [40, 5]]
    text = run_packing(None, 8, 64, 0, runs=[str(run)])
    # the run's two batches are the table's batches of that row: its numbers are the plans' of those lengths
    # (the planner's own numbers are checked by hand in tests/unit/test_packing_plan.py)
    row = [ln for ln in text.splitlines() if ln.startswith("| demo_run | 1 |")]
    assert row, text
    assert "`demo_run`: recorded, 2 trained batches of 2-3 rows, 5-40 tokens per row (median 20)" in text
    before = sum(round_robin_plan(b, 1, 64).padding_share(b) for b in ([10, 30, 20], [40, 5])) / 2
    after = sum(plan_packing(b, 1, 64).padding_share(b) for b in ([10, 30, 20], [40, 5])) / 2
    assert before > 0 and f"{before:.1%} -> {after:.1%}" in row[0]
    (run / "trained_ids.jsonl").write_text(json.dumps({"step": 1, "traj_ids": ["a"]}) + "\n")
    with pytest.raises(ConfigError, match="records no row lengths"):
        recorded_batches(run)
    with pytest.raises(ConfigError, match="no trained_ids.jsonl there"):
        recorded_batches(tmp_path)
