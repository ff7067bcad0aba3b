"""`megarl bench --preemption`'s summary and report on hand-made runs (hand-computed numbers), and its refusals."""
import pytest

from megarl.bench.preemption import render, run_preemption, summarize
from megarl.errors import ConfigError


def run(thrown, first, generated, trained):
    return {"thrown_away_per_stop": thrown, "first_step_after_resume_s": first,
            "generated_per_trained": generated / trained}


def test_summary_means_and_per_round_ratios():
    runs = {"prompts": [run(1000, 20.0, 1200, 1000), run(1400, 30.0, 1300, 1000)],
            "whole": [run(0, 10.0, 1100, 1000), run(0, 30.0, 1040, 1000)]}
    s = summarize(runs)
    assert s["prompts"]["thrown_away_per_stop"]["mean"] == pytest.approx(1200)
    assert s["whole"]["thrown_away_per_stop"]["mean"] == 0
    assert s["whole"]["first_step_after_resume_s"]["mean"] == pytest.approx(20.0)
    # whole / prompts per round: 10/20 = 0.5 and 30/30 = 1, geometric mean sqrt(0.5)
    r = s["ratios"]["first_step_after_resume_s"]
    assert r["per_repeat"] == pytest.approx([0.5, 1.0]) and r["ratio"] == pytest.approx(0.5 ** 0.5)
    g = s["ratios"]["generated_per_trained"]
    assert g["per_repeat"] == pytest.approx([1.1 / 1.2, 1.04 / 1.3])
    # a ratio of whole's zero thrown-away tokens would mean nothing: none is taken
    assert "thrown_away_per_stop" not in s["ratios"]


def test_report_table_and_ratio_lines():
    runs = {"prompts": [run(1458, 22.53, 1164, 1000)], "whole": [run(0, 23.16, 1082, 1000)]}
    text = render({"config": "c.yaml", "steps": 9, "stops": [3, 6], "schedule": "one run each",
                   "summary": summarize(runs)})
    assert "| prompts only (keep_running_groups=false) | 1458 | 22.53 | 1.164 |" in text
    assert "| whole (megarl) | 0 | 23.16 | 1.082 |" in text
    assert "whole / prompts, generated tokens per trained token: 0.930 (one repeat: no interval)" in text


@pytest.mark.parametrize("stops", [[], [0], [3, 2], [2, 2], [9]])
def test_stops_that_leave_no_step_after_them_are_refused(tmp_path, stops):
    with pytest.raises(ConfigError, match="give increasing steps from 1 to below --steps 9"):
        run_preemption("configs/bench_preempt_cpu.yaml", [], str(tmp_path / "out"), stops, 9, 1)
    assert not (tmp_path / "out").exists()
