"""The engines `megarl train` starts itself take placement.engine_tp as `megarl launch` does: a vLLM engine of k
tensor-parallel workers (the plan says "vLLM TP=k; spawned by the controller"), on k GPUs of its own.

GPU ids are worked out with a machine of 8 GPUs described to torch.cuda (no GPU here); the CPU engine of two
workers runs in tests/e2e/test_broadcast.py.
"""
import pytest
import torch

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.rollout.engine_pool import engine_launch_kwargs
from megarl.rollout.local_gpus import engine_gpu_env

TINY = "configs/tiny_cpu.yaml"


def _args(*overrides):
    return engine_launch_kwargs(load_run_config(TINY, list(overrides)), "ckpt", 0)["extra_args"]


def test_a_spawned_vllm_engine_has_engine_tp_workers():
    assert "--tensor-parallel-size" not in _args("rollout.backend=vllm")
    args = _args("rollout.backend=vllm", "placement.engine_tp=2")
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(ConfigError, match="placement.engine_tp=2 needs rollout.backend=vllm"):
        _args("rollout.backend=hf", "placement.engine_tp=2")


@pytest.fixture
def eight_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the trainer's ranks hold GPUs 0 and 1


def test_each_engine_gets_engine_tp_gpus_after_the_trainers(eight_gpus):
    assert engine_gpu_env(0, 3) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert engine_gpu_env(2, 3) == {"CUDA_VISIBLE_DEVICES": "4"}
    assert engine_gpu_env(0, 3, tp=2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert engine_gpu_env(2, 3, tp=2) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(ConfigError, match=r"placement.engine_tp=2 of its own \(10 in all\): set rollout.n_engines=3"):
        engine_gpu_env(0, 4, tp=2)
