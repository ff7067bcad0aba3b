"""`megarl advise` end to end on the tiny MoE with the fp32 HF engine: one calibration, two timing runs.

In fp32 the engine and the trainer compute the same network, so what advise measures is checked against
something it does not share: the train-inference gap must be the fp32 round-off (the engine oracle of
verify-recovery), the trainer's routers must choose the engine's experts at the sampling version (no
same-version flip), and with nothing to correct the rules must say that exactness cannot change the update.
The config keeps routing replay off: the calibration captures routes to count flips all the same.
"""
import json
from pathlib import Path

from conftest import run_megarl


def test_advise_measures_calibrates_times_and_recommends_on_the_tiny_moe(moe_ckpt, tmp_path):
    out = tmp_path / "advise"
    r = run_megarl("advise", "--config", "configs/verify_cpu.yaml", "--steps", "4", "--cost-steps", "3",
                   "--strategies", "behav,snapshot", "--output", str(out), f"model.checkpoint={moe_ckpt}",
                   "model.init_model=configs/models/tiny_qwen3_moe.yaml", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"wrote {out / 'advise.json'}" in r.stdout and f"wrote {out / 'advise.png'}" in r.stdout
    assert "| strategy | measured cost / step |" in r.stdout and "Recommended: " in r.stdout
    m = json.loads((out / "advise.json").read_text())
    assert Path(m["paths"]["picture"]).stat().st_size > 10_000
    cal = m["calibration"]
    assert cal["n_batches"] == 4 and cal["gap"]["n"] > 0
    assert cal["gap"]["max"] <= 1e-5, cal["gap"]  # fp32 engine = fp32 trainer
    assert cal["staleness"]["spliced_frac"] > 0 and cal["staleness"]["lag_max"] >= 1, cal["staleness"]
    # behav's anchor is the exact one to round-off; each approximate anchor is measured at its real distance
    assert cal["anchors"]["behav"]["max"] <= 1e-5 and cal["anchors"]["behav"]["clip_differs_frac"] == 0.0
    assert {"ewma", "recompute", "loglinear", "linear"} <= set(cal["anchors"])
    assert cal["anchors"]["recompute"]["max"] > 1e-4, cal["anchors"]["recompute"]
    assert cal["routes"]["same_version"]["tokens_differ_frac"] == 0.0, cal["routes"]
    assert cal["routes"]["same_version"]["n_tokens"] > 0
    assert any("routing_replay=true" in n for n in m["notes"])
    runs = m["cost"]["runs"]
    assert set(runs) == {"behav", "snapshot"} and runs["behav"]["added_step_s"] < 0.01  # bench's hook timers only
    assert runs["snapshot"]["added_step_s"] > runs["behav"]["added_step_s"], runs
    assert runs["snapshot"]["publish_stall_s_median"] > 0
    rec = m["recommendation"]
    assert rec["exactness_matters"] is False and rec["strategy"] in ("behav", "ewma", "linear"), rec
    assert rec["routing_replay"] is False, rec
