"""`megarl advise` end to end on the tiny MoE with the fp32 HF engine: one calibration, two timing runs.

In fp32 the engine and the trainer compute the same network, so what advise measures is checked against
something it does not share: the train-inference gap must be the fp32 round-off (the engine oracle of
verify-recovery), the trainer's routers must choose the engine's experts at the sampling version (no
same-version flip), and with nothing to correct the rules must say that exactness cannot change the update.
The config keeps routing replay off: the calibration captures routes to count flips all the same.

The timing runs go in two interleaved rounds (behav, snapshot; snapshot, behav), and a CPU-burning process
starts inside the second of them and runs to the end, as other work on a shared machine would; the costs
come out as medians over the repeats with their intervals. (Whether such an interval covers the quiet
machine's value is checked on simulated step timings, tests/unit/test_bench_interleave.py: on a shared
2-core machine a real run cannot know its quiet value.)
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from conftest import ENV, MEGARL, ROOT


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_with_a_burner(args: list[str], start_on: str, timeout: float) -> SimpleNamespace:
    """`megarl ARGS`; a CPU burner starts 2 s after the output line holding ``start_on`` and runs until the
    command ends. Returns returncode, stdout, stderr and the burner's CPU seconds."""
    p = subprocess.Popen([*MEGARL, *args], cwd=ROOT, env={**ENV, "PYTHONUNBUFFERED": "1"}, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    lines, burner, burned = [], None, 0.0
    try:
        for line in p.stdout:
            lines.append(line)
            if burner is None and start_on in line:
                time.sleep(2.0)
                burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        rc = p.wait()
    finally:
        timer.cancel()
        p.kill()
        if burner is not None:
            burned = _cpu_seconds(burner.pid)
            burner.kill()
            burner.wait()
    reader.join(timeout=10)
    return SimpleNamespace(returncode=rc, stdout="".join(lines), stderr="".join(err), burner_cpu_s=burned)


def test_advise_measures_calibrates_times_and_recommends_on_the_tiny_moe(moe_ckpt, tmp_path):
    out = tmp_path / "advise"
    r = _run_with_a_burner(["advise", "--config", "configs/verify_cpu.yaml", "--steps", "4", "--cost-steps", "3",
                            "--repeats", "2", "--strategies", "behav,snapshot", "--output", str(out),
                            f"model.checkpoint={moe_ckpt}", "model.init_model=configs/models/tiny_qwen3_moe.yaml"],
                           "[cost] snapshot: 3 steps (repeat 1 of 2)", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.burner_cpu_s > 2.0, r.burner_cpu_s  # the burner did burn, beside the last three timing runs
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
    # two interleaved rounds, every cost with its interval over them
    assert m["cost"]["repeats_done"] == 2 and m["cost"]["order"] == [[0, "behav"], [0, "snapshot"], [1, "snapshot"],
                                                                     [1, "behav"]]
    assert (out / "cost" / "repeats" / "behav_2" / "metrics.jsonl").exists()
    for name in ("behav", "snapshot"):
        share, ratio = runs[name]["share_interval"], runs[name]["step_ratio_to_behav"]
        assert len(runs[name]["per_repeat"]) == 2 and share["n"] == ratio["n"] == 2
        assert share["low"] <= share["share"] <= share["high"] and ratio["low"] <= ratio["ratio"] <= ratio["high"]
    assert "Costs: medians over 2 of 2 repeats of 3 steps, interleaved" in r.stdout
    rec = m["recommendation"]
    assert rec["exactness_matters"] is False and rec["strategy"] in ("behav", "ewma", "linear"), rec
    assert rec["routing_replay"] is False, rec
