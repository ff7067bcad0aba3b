"""rollout.batch_invariant: refused where it cannot run, and wired into the engines' environment and the
trainer's model config. The kernels themselves run on GPU only (tests/gpu)."""
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.platform import batch_invariant

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_off_by_default_and_refused_on_cpu_naming_the_fix():
    off = load_run_config(TINY)
    assert off.rollout.batch_invariant is False and batch_invariant.engine_env(off) == {}
    batch_invariant.check(off, cuda=False)  # off: nothing to refuse
    on = load_run_config(TINY, ["rollout.batch_invariant=true"])
    with pytest.raises(ConfigError, match="needs CUDA GPUs.*set rollout.batch_invariant=false on CPU"):
        batch_invariant.check(on)
    with pytest.raises(ConfigError, match="needs rollout.backend=vllm"):
        batch_invariant.check(load_run_config(TINY, ["rollout.batch_invariant=true", "rollout.backend=hf"]), cuda=True)
    with pytest.raises(ConfigError, match="leave rollout.dtype empty"):
        batch_invariant.check(load_run_config(TINY, ["rollout.batch_invariant=true", "rollout.dtype=bfloat16"]),
                              cuda=True)
    batch_invariant.check(on, cuda=True)  # a GPU run with vllm engines of the trainer's dtype
    with pytest.raises(ConfigError, match="the trainer has no CUDA device"):
        batch_invariant.enable_in_trainer(object())


def test_spawned_engines_get_vllm_batch_invariant(tmp_path, monkeypatch):
    import megarl.builder as builder

    seen = []
    monkeypatch.setattr(builder, "launch_engine_process", lambda *a, **kw: seen.append(kw.get("env")))
    cfg = load_run_config(TINY, ["rollout.batch_invariant=true"])
    starts = builder._EngineStarts.__new__(builder._EngineStarts)  # only its launch(): no engines started
    starts.cfg, starts.ckpt, starts.run_dir, starts.launches = cfg, tmp_path, tmp_path, [0]
    starts.launch(0)
    starts.cfg = load_run_config(TINY)
    starts.launch(0)
    assert seen == [{"VLLM_BATCH_INVARIANT": "1"}, None]


def test_the_trainer_switches_its_model_config_before_building(monkeypatch):
    """With a CUDA device (faked here), enable_in_trainer sets megatron-core's batch_invariant_mode and the
    FlashAttention backend it requires on the config, and enables the kernels process-wide."""
    import torch
    from megatron.core.transformer.custom_layers import batch_invariant_kernels
    from megatron.core.transformer.enums import AttnBackend

    enabled = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(batch_invariant_kernels, "enable_batch_invariant_mode", lambda: enabled.append(True))

    class Config:
        batch_invariant_mode = False
        attention_backend = AttnBackend.auto

    cfg = Config()
    batch_invariant.enable_in_trainer(cfg)
    assert (cfg.batch_invariant_mode, cfg.attention_backend, enabled) == (True, AttnBackend.flash, [True])


def test_launched_engine_roles_get_it_in_their_environment(monkeypatch):
    import os

    import megarl.commands.train as train
    from megarl.launch.roles import current_role

    seen = []

    async def fake_serve(*args, **kwargs):
        seen.append(os.environ.get("VLLM_BATCH_INVARIANT"))

    monkeypatch.setattr(train, "serve", fake_serve)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # restored after the test
    role = current_role({"MEGARL_ROLE": "engine", "MEGARL_SERVER_PORT": "8100"})
    train.serve_role(load_run_config(TINY, ["rollout.batch_invariant=true"]), role)
    assert seen == ["1"]


def test_moe_models_and_hosts_without_cuda_or_flash_attn_are_refused(monkeypatch):
    import importlib.util

    import torch

    on = load_run_config(TINY, ["rollout.batch_invariant=true"])
    with pytest.raises(ConfigError, match="grouped GEMM"):
        batch_invariant.check(on, cuda=True, hf={"num_experts": 8})
    batch_invariant.check(on, cuda=True, hf={"num_experts": 0})
    with pytest.raises(ConfigError, match="this trainer host has no CUDA device"):
        batch_invariant.check_host(on)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(ConfigError, match="needs the flash_attn package"):
        batch_invariant.check_host(on)
    batch_invariant.check_host(load_run_config(TINY))  # off: nothing to check


def test_gpu_placement_is_what_the_settings_check_reads():
    gpu = load_run_config(TINY, ["rollout.batch_invariant=true", "placement.device=gpu"])
    batch_invariant.check(gpu)  # on a host without CUDA (plan, launch from a login node): the placement decides
