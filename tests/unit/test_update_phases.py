"""The weight update's stall phases: the clock, the slowest-engine merge and the stall loop's medians."""
import time

import pytest

from megarl.bench.stall import summarize_phases
from megarl.rollout.base import UPDATE_PHASES, PhaseClock, slowest_phases


def test_phase_clock_sums_repeated_phases_and_reports_every_phase():
    clock = PhaseClock()
    with clock.phase("reload"):
        time.sleep(0.01)
    with clock.phase("resume"):
        pass
    with clock.phase("reload"):
        time.sleep(0.01)
    s = clock.seconds()
    assert list(s) == [f"engine_{p}_s" for p in UPDATE_PHASES]
    assert s["engine_reload_s"] >= 0.02 and s["engine_abort_s"] == s["engine_pause_s"] == 0.0
    assert clock.total() == pytest.approx(sum(s.values()))
    with pytest.raises(ValueError, match="unknown update phase 'load'"):
        with clock.phase("load"):
            pass


def test_slowest_phases_takes_the_max_per_phase():
    a = {"engine_pause_s": 0.02, "engine_reload_s": 0.010}
    b = {"engine_pause_s": 0.00, "engine_reload_s": 0.015}
    assert slowest_phases([a, None, b]) == {"engine_pause_s": 0.02, "engine_reload_s": 0.015}
    assert slowest_phases([None, None]) is None and slowest_phases([]) is None


def test_summarize_phases_medians():
    samples = [{"engine_abort_s": 0.0, "engine_pause_s": 0.0, "engine_reload_s": r, "engine_cache_reset_s": 0.001,
                "engine_resume_s": 0.0005} for r in (0.010, 0.014, 0.012)]
    out = summarize_phases(samples)
    assert out["engine_reload_s"] == pytest.approx(0.012)
    # per update: 0.0115, 0.0155, 0.0135 -> median 0.0135
    assert out["engine_update_s"] == pytest.approx(0.0135)
    assert out["engine_pause_s"] == 0.0
