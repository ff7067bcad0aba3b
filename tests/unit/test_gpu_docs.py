"""What the GPU instructions say must work as written: download command, install order, the shipped layouts' sizes."""
import re
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.launch import cluster
from megarl.launch.placement import load_hf_config, resolve_plan

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.yaml"))]


def test_no_removed_download_command():
    # huggingface_hub >= 1 ships `hf download`; `huggingface-cli` is gone
    assert [p.name for p in TEXTS if "huggingface-cli" in p.read_text()] == []


def test_gpu_extra_does_not_build_transformer_engine_with_isolation():
    extra = re.search(r'"gpu": \[([^\]]*)\]', (ROOT / "setup.py").read_text()).group(1)
    assert "vllm" in extra and "transformer" not in extra


@pytest.mark.parametrize("config", ["qwen3_4b_h100.yaml", "qwen3_30b_a3b_h100.yaml"])
def test_readme_cost_table_names_the_plans_gpus_and_nodes(config):
    cfg = load_run_config(ROOT / "configs" / config)
    hf, _ = load_hf_config(cfg)
    plan = resolve_plan(cfg, hf, cluster.simulated(8, cfg.placement.gpus_per_node))
    nodes = len(plan.trainer.hosts) + len({s.host for s in plan.engines})
    engine_gpus = sum(s.tp for s in plan.engines)
    header = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| strategy |"))
    cell = next(c for c in header.split("|") if config in c)
    said = re.search(r"(\d+) trainer \+ (\d+) engine H100(?: on (\d+) nodes)?", cell)
    assert said, cell
    assert (int(said.group(1)), int(said.group(2))) == (plan.trainer.world_size, engine_gpus)
    assert int(said.group(3) or 2) == nodes
