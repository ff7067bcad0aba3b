"""`megarl train` on a multi-GPU machine gives each engine it starts a GPU of its own (CUDA faked on CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.errors import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    def make(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return make


def launched_envs(n_engines: int, tmp_path: Path, monkeypatch) -> list:
    """The env every engine process of a run would be started with (the launch itself is captured)."""
    from megarl import builder
    from megarl.config import MegaRLConfig

    envs = []
    monkeypatch.setattr(builder, "launch_engine_process", lambda *a, **kw: envs.append(kw.get("env")))
    cfg = MegaRLConfig()
    cfg.rollout.n_engines = n_engines
    starts = builder._EngineStarts.__new__(builder._EngineStarts)
    starts.cfg, starts.ckpt, starts.run_dir, starts.launches = cfg, tmp_path, tmp_path, [0] * n_engines
    for i in range(n_engines):
        starts.launch(i)
    return envs


def test_engines_get_the_gpus_after_the_trainer(gpus, tmp_path, monkeypatch):
    gpus(8)
    assert launched_envs(3, tmp_path, monkeypatch) == [{"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"},
                                                       {"CUDA_VISIBLE_DEVICES": "3"}]


def test_visible_devices_and_local_trainer_ranks(gpus, tmp_path, monkeypatch):
    gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launched_envs(2, tmp_path, monkeypatch) == [{"CUDA_VISIBLE_DEVICES": "6"}, {"CUDA_VISIBLE_DEVICES": "7"}]


def test_too_few_gpus_is_refused(gpus, tmp_path, monkeypatch):
    gpus(8)
    with pytest.raises(ConfigError, match=r"has 8 GPUs; the trainer takes 1 .* set rollout.n_engines=7 or fewer"):
        launched_envs(8, tmp_path, monkeypatch)


def test_one_gpu_or_none_is_left_alone(gpus, tmp_path, monkeypatch):
    gpus(1)
    assert launched_envs(2, tmp_path, monkeypatch) == [None, None]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launched_envs(2, tmp_path, monkeypatch) == [None, None]
