"""The real `megarl bench` console script: 2 strategies x 3 steps with the vLLM CPU engine, started
without VLLM_CPU_KVCACHE_SPACE and OMP_NUM_THREADS; then each further mode in its smoke setting (2 steps,
tiny batches, the HF engine, which starts in seconds): --compare-sync and --sweep (four runs each) and
--quality (two, then the same command again, which reuses both). Benchmarks are commands; these tests
check that they run and write what they promise, not numbers.

The runs of one command share their engines when the engine settings agree (megarl/rollout/engine_pool.py);
each test takes ~1-2 minutes.
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

from megarl.platform.cpu_affinity import format_cores

REPO = Path(__file__).resolve().parents[2]
MEGARL = shutil.which("megarl", path=str(Path(sys.executable).parent)) or "megarl"
FIELDS = {"step_time_s_median", "recovery_s_median", "critical_path_overhead_frac", "gen_stall_frac",
          "peak_rss_mb", "extra_param_copies", "bytes_moved", "max_abs_err_vs_exact"}


def test_bench_two_strategies(tmp_path):
    out = tmp_path / "bench"
    cmd = [MEGARL, "bench", "--config", "configs/bench_cpu.yaml", "--strategies", "snapshot,loglinear",
           "--steps", "3", "--repeats", "1", "--output", str(out), "rollout.backend=vllm", "trainer.batch_size=16",
           "rollout.max_new_tokens=24", f"model.checkpoint={tmp_path / 'ckpt'}"]
    # as in a new user's shell: the engines' KV cache and threads come from the config
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PASS" in p.stdout or "SKIP" in p.stdout  # the target lines are printed

    report = json.loads((out / "report.json").read_text())
    assert report["async_vs_sync"] == {"throughput_ratio": None, "throughput_ratio_disjoint_cores": None}
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
    # snapshot scores with a forward per version in the batch, loglinear interpolates from the step's own forward
    # and spends none: counted, not timed (which recovery time is larger flips with the machine's load; `megarl
    # bench` reports the times with their interval)
    forwards = {name: [json.loads(line).get("recovery/forwards", 0.0) for line in (out / name / "metrics.jsonl").open()]
                for name in ("snapshot", "loglinear")}
    assert len(forwards["snapshot"]) == 3 and min(forwards["snapshot"]) >= 1, forwards
    assert forwards["loglinear"] == [0.0] * 3, forwards
    assert [t["passed"] for t in report["targets"]] == [None] * 6  # none measurable with these two
    for name in ("snapshot", "loglinear"):  # two publishes: each one's stall in parts, the vLLM engine's own
        stall = report["publish_stall_s_median"][name]
        assert stall["engine_reload"] > 0 and stall["engine_pause"] == 0  # nothing in flight after the drain
        assert 0 < stall["engine_reload"] < stall["stall"] < 60

    md = (out / "report.md").read_text()
    assert "| snapshot |" in md and "| loglinear |" in md and "SKIP" in md
    assert "one run each, one after another (no repeats: no intervals)" in md  # --repeats 1
    assert "- loglinear / snapshot: " in md and "(one repeat: no interval)" in md  # against the first
    assert "## Publish stall per publish (median ms)" in md
    for png in ("overhead.png", "reward.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("snapshot", "loglinear"):
        assert len((out / name / "metrics.jsonl").read_text().splitlines()) == 3
    # one engine served both runs
    assert "kv cache 1 GiB, 1 CPU thread(s)" in (out / "engines" / "engine0.log").read_text()  # rollout.* defaults
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["engine0.log"]


SMOKE = ["--steps", "2", "rollout.backend=hf", "trainer.batch_size=8", "rollout.max_new_tokens=8"]
PNG = b"\x89PNG\r\n\x1a\n"


def _bench(tmp_path, *args, timeout=400):
    cmd = [MEGARL, "bench", *args, f"model.checkpoint={tmp_path / 'ckpt'}"]
    p = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_compare_sync_smoke(tmp_path):
    out = tmp_path / "cs"
    cores = sorted(os.sched_getaffinity(0))
    _bench(tmp_path, "--config", "configs/bench_cpu.yaml", "--compare-sync", "--eta", "2", "--repeats", "1",
           "--output", str(out), *SMOKE)
    report = json.loads((out / "report.json").read_text())
    avs = report["async_vs_sync"]
    for key in ("throughput_ratio", "throughput_ratio_disjoint_cores"):
        assert isinstance(avs[key], float) and avs[key] > 0, avs
    half = len(cores) // 2
    trainer, engines = cores[:half], cores[half:]
    assert report["meta"]["compare_sync"]["eta"] == 2 and report["strategies"] == {}  # --compare-sync alone
    for run in ("async_eta2_disjoint", "sync_eta0_disjoint"):  # the trainer and its engine each on their cores
        assert json.loads((out / run / "bench_child.json").read_text())["trainer_cores"] == trainer
    shared = json.loads((out / "async_eta2" / "bench_child.json").read_text())["trainer_cores"]
    # the two runs on shared cores share an engine, the two on disjoint cores one started on its cores
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["engine0.launch1.log", "engine0.log"]
    assert f"on core(s) {format_cores(engines)}" in (out / "engines" / "engine0.launch1.log").read_text()
    assert shared == cores and "on core(s)" not in (out / "engines" / "engine0.log").read_text()
    md = (out / "report.md").read_text()
    assert f"trainer on core(s) {format_cores(trainer)}, engines on core(s) {format_cores(engines)}" in md


def test_sweep_smoke(tmp_path):
    out = tmp_path / "sweep"
    p = _bench(tmp_path, "--sweep", "--models", "tiny_qwen3,tiny_qwen3_s", "--etas", "1,2", "--strategies",
               "snapshot", "--output", str(out), *SMOKE)
    assert "4 runs of 2 steps: about" in p.stdout  # the estimate comes first
    rep = json.loads((out / "report.json").read_text())
    rows = rep["sweep"]["rows"]
    assert [(r["model"], r["eta"]) for r in rows] == [("tiny_qwen3", 1), ("tiny_qwen3", 2), ("tiny_qwen3_s", 1),
                                                     ("tiny_qwen3_s", 2)]
    for r in rows:  # snapshot holds at least the published version and scores with a forward
        assert r["extra_bytes_held"] >= r["weights_nbytes"] > 0 and r["recovery_s_median"] > 0
        assert r["stall_per_publish_s"] > 0 and r["seq_tokens_mean"] > 0
    assert rows[2]["weights_nbytes"] > 5 * rows[0]["weights_nbytes"]  # 0.99M vs 0.13M parameters
    assert set(rep["sweep"]["growth"]) == set(rep["sweep"]["fits"]) == {"snapshot"}
    assert (out / "scaling.png").read_bytes()[:8] == PNG
    # the two etas of a model share an engine; the other model gets its own
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["engine0.launch1.log", "engine0.log"]
    for log, model in (("engine0.log", "tiny_qwen3"), ("engine0.launch1.log", "tiny_qwen3_s")):
        assert f"serving {out / 'checkpoints' / model} on" in (out / "engines" / log).read_text()
    md = (out / "report.md").read_text()
    assert "## Which costs grow with eta" in md and "## Fitted growth of recovery seconds" in md


def test_quality_smoke(tmp_path):
    out = tmp_path / "quality"
    p = _bench(tmp_path, "--quality", "--strategies", "behav", "--etas", "8", "--seeds", "2", "--output",
               str(out), *SMOKE)
    assert "2 runs of 2 steps: about" in p.stdout
    rep = json.loads((out / "report.json").read_text())
    final = rep["quality"]["final"]
    assert [(r["strategy"], r["eta"]) for r in final] == [("behav", 8)]
    assert all(len(r["per_seed"]) == 2 and 0 <= r["mean"] <= 1 for r in final)
    assert all(c["step"] == [1, 2] for c in rep["quality"]["curves"])
    assert (out / "quality.png").read_bytes()[:8] == PNG
    assert "| behav | 8 |" in (out / "report.md").read_text()
    (row,) = final
    assert row["steps_to_threshold"]["of"] == 2 and row["r_d_abs_logp_mean"] is None  # behav's anchor is not exact
    assert 0 <= row["active_frac_min"] <= 1 and rep["quality"]["vs_behav"] == []
    assert all((out / "runs" / f"behav_eta8_seed{s}" / "done.json").exists() for s in (0, 1))
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["engine0.log"]  # both seeds on one engine
    # the same command again: both runs finished, so nothing starts and the report is the same
    p = _bench(tmp_path, "--quality", "--strategies", "behav", "--etas", "8", "--seeds", "2", "--output",
               str(out), *SMOKE)
    assert "2 of 2 runs finished before" in p.stdout and "0 runs of 2 steps" in p.stdout
    assert json.loads((out / "report.json").read_text())["quality"]["final"] == final
    assert sorted(p.name for p in (out / "engines").iterdir()) == ["engine0.log"]  # nor an engine


def test_preemption_smoke(tmp_path):
    """--preemption with 2 trainer ranks (each run `megarl launch --launcher torchrun`, the SIGTERM sent to the
    launch): one round, each variant stopped once after step 1 and resumed to step 3 (HF engine, single-turn
    answers of 48 tokens, so the stop finds groups mid-answer). Running groups kept whole: no generated token
    thrown away and none regenerated; with their prompts only the resume throws tokens away and counts them."""
    out = tmp_path / "pre"
    p = _bench(tmp_path, "--preemption", "--config", "configs/bench_preempt_cpu.yaml", "--stops", "1", "--steps",
               "3", "--repeats", "1", "--output", str(out), "rollout.backend=hf", "rollout.max_new_tokens=48",
               "placement.trainer_ranks=2")
    rep = json.loads((out / "report.json").read_text())
    whole, prompts = rep["runs"]["whole"][0], rep["runs"]["prompts"][0]
    for r in (whole, prompts):
        assert r["steps"] == 3 and r["n_stops"] == 1 and r["trained_tokens"] > 0, r
        assert r["generated_tokens"] >= r["trained_tokens"] and r["first_step_after_resume_s"] > 0, r
    assert whole["thrown_away_tokens"] == 0 and whole["regenerated"] == 0 and whole["continued"] > 0, whole
    assert prompts["thrown_away_tokens"] > 0 and prompts["regenerated"] > 0 and prompts["continued"] == 0, prompts
    assert "| whole (megarl) | 0 |" in p.stdout and "whole / prompts, generated tokens per trained token" in p.stdout
    assert (out / "report.md").read_text() in p.stdout
    log = (out / "whole-r0.log").read_text()
    assert "torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2" in log, log[-3000:]
    assert "stopped on SIGUSR1" in log and "exit code 75" in log, log[-3000:]  # the launch passed the stop on
