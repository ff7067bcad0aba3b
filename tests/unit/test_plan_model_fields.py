"""Which model a plan is made for: a checkpoint pointed elsewhere on the command line is not planned with the
config's own model fields."""
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.cli import main
from megarl.errors import ConfigError
from megarl.launch.placement import load_hf_config

CONFIG = "configs/qwen3_4b_h100.yaml"
REPO = Path(__file__).resolve().parents[2]


def test_the_configs_own_checkpoint_is_planned_with_its_model_fields():
    cfg = load_run_config(CONFIG)
    hf, source = load_hf_config(cfg, [])
    assert source == str(REPO / "configs/models/qwen3_4b.yaml") and hf["num_hidden_layers"] == 36  # resolved


def test_another_unreadable_checkpoint_is_refused_unless_its_fields_are_given(tmp_path):
    over = [f"model.checkpoint={tmp_path}/Qwen3-8B"]
    with pytest.raises(ConfigError, match="placement.model_config=YAML"):
        load_hf_config(load_run_config(CONFIG, over), over)
    told = [*over, "placement.model_config=configs/models/qwen3_30b_a3b.yaml"]
    assert load_hf_config(load_run_config(CONFIG, told), told)[1] == "configs/models/qwen3_30b_a3b.yaml"


def test_plan_and_launch_dry_run_refuse_it(tmp_path, capsys):
    over = f"model.checkpoint={tmp_path}/Qwen3-8B"
    assert main(["plan", "--config", CONFIG, over]) == 2
    assert main(["launch", "--dry-run", "--launcher", "slurm", "--nodes", "2", "--gpus-per-node", "8",
                 "--config", CONFIG, over]) == 2
    assert capsys.readouterr().err.count("has no config.json on this machine") == 2
