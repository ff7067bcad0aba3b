"""An engine's KV cache and CPU threads come from rollout.kv_cache_gb / rollout.cpu_threads or the same-named
flags, never only from VLLM_CPU_KVCACHE_SPACE / OMP_NUM_THREADS (the real engines: tests/e2e)."""
import asyncio
from pathlib import Path

import pytest
import torch
from recovery_scorer import tiny_checkpoint

from megarl.builder import load_run_config
from megarl.cli import build_parser
from megarl.config.schema import RolloutConfig
from megarl.errors import ConfigError
from megarl.preflight import validate
from megarl.rollout.base import engine_options, resources_note

REPO = Path(__file__).resolve().parents[2]


def test_engine_options_per_backend():
    assert engine_options("vllm", 2, 3) == {"kv_cache_gib": 2, "cpu_threads": 3}
    assert engine_options("vllm", 1, 0) == {"kv_cache_gib": 1}  # 0 threads: the environment's
    assert engine_options("hf", 4, 2) == {"cpu_threads": 2}  # the HF engine has no KV cache to size
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_gb \(--kv-cache-gb\) must be >= 1 GiB, got 0"):
        engine_options("vllm", 0, 1)
    with pytest.raises(ConfigError, match=r"rollout\.cpu_threads \(--cpu-threads\) must be >= 0"):
        engine_options("hf", 1, -1)


def test_the_kv_block_size_goes_to_vllm_alone():
    assert engine_options("vllm", 1, 1, kv_block_size=32) == {"kv_cache_gib": 1, "cpu_threads": 1, "block_size": 32}
    assert "block_size" not in engine_options("vllm", 1, 1, kv_block_size=0)  # vLLM's own
    with pytest.raises(ConfigError, match=r"rollout\.kv_block_size .* with the hf engine, which has no paged KV "
                                          r"cache: set it to 0"):
        engine_options("hf", 1, 1, kv_block_size=32)
    with pytest.raises(ConfigError, match=r"a number of tokens >= 1, or 0 for vLLM's own; got -32 with the vllm"):
        engine_options("vllm", 1, 1, kv_block_size=-32)
    cfg = load_run_config(REPO / "configs" / "tiny_cpu.yaml", ["rollout.backend=hf", "rollout.kv_block_size=32"])
    with pytest.raises(ConfigError, match="rollout.kv_block_size"):  # before anything starts
        validate(cfg, {"vocab_size": 16, "max_position_embeddings": 128})


def test_the_engine_command_gets_the_kv_block_size(monkeypatch, tmp_path):
    from megarl.rollout import client

    seen = {}

    def popen(cmd, **kw):
        seen["cmd"] = cmd
        raise OSError("not started here")

    monkeypatch.setattr(client.subprocess, "Popen", popen)
    with pytest.raises(OSError, match="not started here"):
        client.launch_engine_process("ckpt", "vllm", port=1, kv_block_size=64, exit_with_parent=False,
                                     log_path=str(tmp_path / "engine.log"))
    assert seen["cmd"][seen["cmd"].index("--kv-block-size") + 1] == "64"
    args = build_parser(only="engine").parse_args(["engine", "--checkpoint", "c", "--kv-block-size", "64"])
    from megarl.commands._engine_args import engine_resource_options

    assert engine_resource_options(args)["block_size"] == 64


@pytest.mark.parametrize("command", ["engine", "generate"])
def test_command_flags_default_to_the_config_defaults(command):
    args = build_parser(only=command).parse_args([command, "--checkpoint", "c", "--input", "i", "--output", "o"]
                                                 if command == "generate" else [command, "--checkpoint", "c"])
    defaults = RolloutConfig()
    assert (args.kv_cache_gb, args.cpu_threads) == (defaults.kv_cache_gb, defaults.cpu_threads) == (1, 1)
    assert args.kv_block_size == defaults.kv_block_size == 0


def test_bad_engine_resources_fail_before_the_run():
    cfg = load_run_config(REPO / "configs" / "tiny_cpu.yaml", ["rollout.kv_cache_gb=0"])
    with pytest.raises(ConfigError, match="rollout.kv_cache_gb"):
        validate(cfg, {"vocab_size": 16, "max_position_embeddings": 128})


def test_resources_note():
    assert resources_note({"kv_cache_gb": 2.0, "cpu_threads": 1}) == ", kv cache 2 GiB, 1 CPU thread(s)"
    assert resources_note({"kv_cache_gb": None, "cpu_threads": None}) == ""
    assert resources_note({"kv_cache_gb": 1.0, "cpu_threads": 1, "kv_block_size": 32, "prefix_caching": True}) == \
        ", kv cache 1 GiB, 1 CPU thread(s), kv block 32 tokens, prefix cache on"


def test_hf_engine_takes_its_cpu_threads(tmp_path):
    from megarl.rollout.hf_engine import HFEngine

    before = torch.get_num_threads()

    async def go():
        engine = await HFEngine.create(str(tiny_checkpoint(tmp_path / "ckpt")), device="cpu", cpu_threads=2)
        try:
            return await engine.health()
        finally:
            await engine.close()

    try:
        assert asyncio.run(go())["cpu_threads"] == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
