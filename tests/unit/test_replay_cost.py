"""`megarl bench` with routing replay reports what replay costs (megarl/bench/replay_cost.py), on the tiny MoE."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _overrides(tmp_path: Path, model: str = "tiny_qwen3_moe") -> list[str]:
    return [f"model.checkpoint={tmp_path / model}", f"model.init_model={ROOT / 'configs/models' / model}.yaml",
            "rollout.routing_replay=true", "rollout.backend=hf", "trainer.batch_size=4", "data.max_prompt_len=8",
            "rollout.max_new_tokens=8"]


def test_measure_reports_route_bytes_and_the_step_ratio(tmp_path):
    from megarl.bench.replay_cost import measure, render_markdown
    from megarl.builder import load_run_config

    cost = measure(load_run_config(str(ROOT / "configs/bench_cpu.yaml"), _overrides(tmp_path)), repeats=2)
    # 2 MoE layers x top-2 experts x 1 byte (uint8: 4 experts)
    assert (cost["n_moe_layers"], cost["top_k"], cost["route_bytes_per_token"]) == (2, 2, 4)
    assert cost["rows"] == 4 and 4 * 8 <= cost["tokens"] <= 4 * 16  # lengths between 8 and 16 tokens
    assert cost["train_step_s_live"] > 0 and cost["train_step_s_replay"] > 0
    assert cost["replay_step_ratio"] == pytest.approx(cost["train_step_s_replay"] / cost["train_step_s_live"])
    # no bound on the ratio itself: a test shares the machine (a suite's other worker), and timings are the
    # benchmark's to report with their interval, not a test's to judge (a loaded suite once gave 0.085)
    assert math.isfinite(cost["replay_step_ratio"]) and cost["replay_step_ratio"] > 0
    pairs = cost["replay_step_interval"]  # the 2 timed pairs, alternated in one process
    assert pairs["n"] == 2 and pairs["low"] <= pairs["ratio"] <= pairs["high"]
    md = render_markdown(cost)
    assert "; per alternated pair x" in md and "over 2 pairs" in md
    assert "## Routing replay" in md and "4 bytes of routes per token (2 MoE layers x top-2)" in md


def test_a_dense_model_has_no_replay_to_cost(tmp_path):
    from megarl.bench.replay_cost import measure
    from megarl.builder import load_run_config
    from megarl.errors import ConfigError

    cfg = load_run_config(str(ROOT / "configs/bench_cpu.yaml"), _overrides(tmp_path, "tiny_qwen3"))
    with pytest.raises(ConfigError, match="is dense: routing replay has nothing to cost"):
        measure(cfg, repeats=1)


def test_bench_writes_the_replay_cost_into_its_report(tmp_path):
    from megarl.bench.run import bench

    rep = bench(str(ROOT / "configs/bench_cpu.yaml"), [], 2, str(tmp_path / "out"), _overrides(tmp_path),
                log=lambda *a: None)
    cost = json.loads((tmp_path / "out" / "report.json").read_text())["routing_replay"]
    assert cost == rep["routing_replay"]
    assert cost["route_bytes_per_token"] == 4 and math.isfinite(cost["replay_step_ratio"])
    # the engines' side: the run's group workload without and with captured routes; the hf engine has no prefix
    # cache, so both prefill every prompt token of every sample
    cfg_group = cost["engine_group_size"]
    assert cost["engine_prompts"] == max(1, 4 // cfg_group) and cost["engine_prompt_len"] == 8
    assert cost["engine_batch_s_plain"] > 0 and math.isfinite(cost["engine_capture_ratio"])
    assert cost["prompt_tokens_prefilled_per_group_plain"] == cost["prompt_tokens_prefilled_per_group_capture"] \
        == cfg_group * 8
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Routing replay" in md and "capturing routes: x" in md
