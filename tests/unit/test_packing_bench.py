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
    text = render(rows, 16, 20000, n_batches=1)
    assert text.count("\n| ") == 3 and "| long_tail | 4 |" in text and "means over 1 batches" in text


def test_the_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "--packing", "--steps", "0",
                          "--packing-rows", "32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "32 rows per batch" in out.stdout and "| bimodal | 64 |" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "megarl.cli", "bench", "--packing", "--packing-rows", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--packing-rows >= 1" in bad.stderr
