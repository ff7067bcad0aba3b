"""The real `megarl bench` console script: 2 strategies x 3 steps with the vLLM CPU engine, started
without VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS.

Each strategy is a full run (engine start-up ~20-50 s), so this test takes ~2 minutes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ENGINE_VARS

REPO = Path(__file__).resolve().parents[2]
MEGARL = shutil.which("megarl", path=str(Path(sys.executable).parent)) or "megarl"
FIELDS = {"step_time_s_median", "recovery_s_median", "critical_path_overhead_frac", "gen_stall_frac",
          "peak_rss_mb", "extra_param_copies", "bytes_moved", "max_abs_err_vs_exact"}


def test_bench_two_strategies(tmp_path):
    out = tmp_path / "bench"
    cmd = [MEGARL, "bench", "--config", "configs/bench_cpu.yaml", "--strategies", "snapshot,loglinear",
           "--steps", "3", "--output", str(out), "rollout.backend=vllm", "trainer.batch_size=16",
           "rollout.max_new_tokens=24", f"model.checkpoint={tmp_path / 'ckpt'}"]
    # as in a new user's shell: the engines' KV cache and threads come from the config
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PASS" in p.stdout or "SKIP" in p.stdout  # the target lines are printed

    report = json.loads((out / "report.json").read_text())
    assert report["async_vs_sync"] == {"throughput_ratio": None}
    assert set(report["strategies"]) == {"snapshot", "loglinear"}
    for name, s in report["strategies"].items():
        assert set(s) == FIELDS, name
        assert 0 < s["step_time_s_median"] < 60
        assert 0 <= s["recovery_s_median"] <= s["step_time_s_median"]
        assert 0 <= s["critical_path_overhead_frac"] < 1
        assert 0 < s["gen_stall_frac"] < 1  # two publishes happened
        assert s["peak_rss_mb"] > 100  # trainer + vLLM engine processes
        assert isinstance(s["bytes_moved"], int) and s["bytes_moved"] > 0  # 2 publishes of the weights at least
        assert math.isfinite(s["max_abs_err_vs_exact"])
    snap, logl = report["strategies"]["snapshot"], report["strategies"]["loglinear"]
    assert snap["max_abs_err_vs_exact"] < 1e-4  # exact
    assert snap["extra_param_copies"] >= 1 and logl["extra_param_copies"] == 0
    assert snap["recovery_s_median"] > logl["recovery_s_median"]  # a forward per version vs none
    assert [t["passed"] for t in report["targets"]] == [None] * 5  # none measurable with these two

    md = (out / "report.md").read_text()
    assert "| snapshot |" in md and "| loglinear |" in md and "SKIP" in md
    for png in ("overhead.png", "reward.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("snapshot", "loglinear"):
        assert len((out / name / "metrics.jsonl").read_text().splitlines()) == 3
        assert "kv cache 1 GiB, 1 CPU thread(s)" in (out / name / "engine0.log").read_text()  # rollout.* defaults
