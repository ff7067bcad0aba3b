"""One set of checks everywhere: `megarl plan`, `megarl launch --dry-run` and `megarl train --check` refuse the
same bad settings before anything starts, and a strategy chosen through `train` or `launch` trains the same
resolved config (the trainer command launch would start, read back by `train --print-config`)."""
import json

import pytest
import yaml

from megarl.cli import main

GPU_4B = "configs/qwen3_4b_h100.yaml"


@pytest.mark.parametrize("command", [
    ["plan", "--config", GPU_4B],
    ["launch", "--dry-run", "--launcher", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--config", GPU_4B],
    ["train", "--check", "--config", "configs/tiny_cpu.yaml"],
])
def test_a_dense_model_with_routing_replay_is_refused_before_anything_starts(command, capsys):
    assert main([*command, "rollout.routing_replay=true"]) == 2
    assert "rollout.routing_replay=true needs an MoE model" in capsys.readouterr().err


def test_train_check_writes_nothing(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    assert main(["train", "--check", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}",
                 "--output-dir", str(out)]) == 0
    assert "all checks passed" in capsys.readouterr().out
    assert not ckpt.exists() and not out.exists(), "a check-only run wrote a checkpoint or a run directory"
    assert main(["train", "--check", "--config", "configs/tiny_cpu.yaml", "data.path=missing.jsonl"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["snapshot", "ewma", "interrupt_sync", "dedicated"])
def test_the_same_strategy_resolves_to_the_same_config_through_train_and_launch(strategy, capsys):
    base = ["--config", "configs/tiny_cpu.yaml", "--recovery", strategy, "trainer.lr=1e-3"]
    assert main(["train", *base, "--print-config"]) == 0
    by_train = capsys.readouterr().out
    assert main(["launch", "--dry-run", "--json", "--launcher", "torchrun", *base]) == 0
    trainer = next(c for c in json.loads(capsys.readouterr().out)["commands"] if c["name"] == "trainer")
    launched = trainer["argv"][trainer["argv"].index("--config"):]  # what the launched trainer resolves
    assert main(["train", *launched, "--print-config"]) == 0
    assert capsys.readouterr().out == by_train
    assert main(["train", "--config", "configs/tiny_cpu.yaml", f"recovery.name={strategy}", "--print-config"]) == 0
    by_name = capsys.readouterr().out
    assert yaml.safe_load(by_name)["loss"] == yaml.safe_load(by_train)["loss"]
