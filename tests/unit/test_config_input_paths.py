"""A config's input paths name the same files from any working directory (megarl/config/input_paths.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.data import read_rows
from megarl.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_a_shipped_config_reads_the_same_files_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(str(REPO / "configs" / "bench_quality_short_cpu.yaml"), [])  # includes tiny_cpu.yaml
    assert cfg.model.init_model == str(REPO / "configs" / "models" / "tiny_qwen3.yaml")
    assert cfg.data.path == str(REPO / "configs" / "data" / "reverse_digits_short_train.jsonl")
    assert cfg.model.checkpoint == "runs/checkpoints/tiny_qwen3_chat"  # an output: where the command runs


def test_a_path_beside_the_config_wins_and_overrides_stay_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "train.jsonl").write_text('{"prompt": "1", "answer": "1"}\n')
    (tmp_path / "proj" / "my.yaml").write_text(f"include: {REPO / 'configs' / 'tiny_cpu.yaml'}\n"
                                               "data:\n  path: data/train.jsonl\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config("proj/my.yaml", [])
    assert cfg.data.path == str(tmp_path / "proj" / "data" / "train.jsonl")
    cfg = load_run_config("proj/my.yaml", ["eval.path=elsewhere.jsonl"])
    assert cfg.eval.path == "elsewhere.jsonl"


def test_a_missing_input_names_each_place_it_was_looked_for(tmp_path, monkeypatch):
    """A file no place has stays as written (a plan may name data prepared later on the cluster); the error of
    the code that cannot read it names every place looked."""
    (tmp_path / "my.yaml").write_text("data:\n  path: nowhere/train.jsonl\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config("my.yaml", [])
    assert cfg.data.path == "nowhere/train.jsonl"
    with pytest.raises(InputError) as e:
        list(read_rows(cfg.data.path))
    msg = str(e.value)
    assert "data.path in " in msg and "my.yaml" in msg
    for place in (tmp_path, REPO):
        assert str(place / "nowhere" / "train.jsonl") in msg, msg
