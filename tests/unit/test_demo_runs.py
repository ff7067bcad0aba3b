"""scripts/demo_runs.py: the measurement of the demo's runs reads the curves and counts as they are."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("demo_runs", ROOT / "scripts" / "demo_runs.py")
demo_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_runs)


def test_loaded_runs_are_spread_and_seeds_taken_in_turn():
    plan = demo_runs.plan_runs(10, [0, 1, 2], 3)
    assert [s for s, _ in plan] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    # spread over the runs and over the seeds: one loaded run of each seed
    assert [(i, s) for i, (s, loaded) in enumerate(plan) if loaded] == [(3, 0), (4, 1), (8, 2)]
    assert sum(loaded for _, loaded in demo_runs.plan_runs(3, [0], 3)) == 3
    assert not any(loaded for _, loaded in demo_runs.plan_runs(4, [0], 0))
    with pytest.raises(SystemExit, match="--loaded 5"):
        demo_runs.plan_runs(4, [0], 5)


def test_seed_zero_is_the_first_command_as_written():
    assert demo_runs.seed_overrides(0) == []
    assert "model.checkpoint=runs/checkpoints/tiny_qwen3_chat_seed2" in demo_runs.seed_overrides(2)


def test_curve_from_metrics_and_count(tmp_path):
    lines = [{"step": 1, "loss": 0.2}, {"step": 200, "eval/pass@1": 0.25},
             {"step": 400, "eval/pass@1": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")
    curve = demo_runs.read_curve(tmp_path / "metrics.jsonl")
    assert curve == {200: 0.25, 400: 0.5}
    recs = [{"run": 0, "seed": 0, "loaded": False, "whole_s": 300.0, "rc": 0, "curve": curve},
            # a round trip through runs.jsonl makes the steps strings
            {"run": 1, "seed": 1, "loaded": True, "whole_s": 420.0, "rc": 0, "curve": {"200": 0.7, "400": 0.49}},
            # a run that failed counts as not learning, whatever it evaluated before
            {"run": 2, "seed": 2, "loaded": True, "whole_s": 60.0, "rc": 1, "curve": {"200": 0.9}}]
    assert [demo_runs.final_pass1(r) for r in recs] == [0.5, 0.49, None]
    assert demo_runs.summary(recs, 0.5) == (
        "1 of 3 runs at held-out pass@1 >= 0.5 at their last evaluation (0 of 2 loaded); "
        "slowest whole command 7.0 min")
    assert "200:0.700 400:0.490" in demo_runs.format_run(recs[1])
