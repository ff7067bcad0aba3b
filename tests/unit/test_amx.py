"""bf16 engines ask the kernel for AMX tile state in every process that runs vLLM's bf16 CPU kernels.

On an AMX host, vLLM's bf16 CPU attention without that request dies of SIGILL
(tests/e2e/test_vllm_bf16.py catches it there; this host may lack AMX, so these
tests check the request itself: the serving process's environment for vLLM's
children, and the worker extension that vLLM imports in each worker).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.platform.amx import REQUEST_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from megarl.models.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3.yaml", tmp_path_factory.mktemp("amx") / "c"))


class _Stop(Exception):
    pass


@pytest.mark.parametrize("dtype,expected", [("bfloat16", "1"), ("float32", None), (None, None)])
def test_a_bf16_vllm_cpu_engine_asks_for_amx_in_its_processes(ckpt, monkeypatch, dtype, expected):
    from vllm.v1.engine.async_llm import AsyncLLM

    import megarl.rollout.vllm_engine as vllm_engine
    import megarl.rollout.vllm_start as vllm_start

    seen = {}
    requested = []

    def fake_start(engine_args, *a, **kw):  # vLLM spawns its engine core here; it inherits this environment
        seen["env"] = os.environ.get(REQUEST_ENV)
        seen["dtype"] = engine_args.dtype
        raise _Stop

    monkeypatch.delenv(REQUEST_ENV, raising=False)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(fake_start))
    monkeypatch.setattr(vllm_start, "request_amx", lambda: requested.append(1) or False, raising=False)
    with pytest.raises(Exception, match="_Stop"):
        asyncio.run(vllm_engine.VLLMEngine.create(ckpt, dtype=dtype))
    assert seen["env"] == expected, seen
    assert seen["dtype"] == (dtype or "float32")
    assert len(requested) == (1 if expected else 0)  # the serving process asks too
    assert os.environ.get(REQUEST_ENV) is None  # restored after vLLM started its processes


@pytest.mark.parametrize("value,calls", [("1", 1), (None, 0)])
def test_the_worker_extension_asks_for_amx_when_the_engine_runs_bf16(value, calls):
    code = ("import torch; calls = []\n"
            "torch._C._cpu._init_amx = lambda: calls.append(1) or True\n"
            "import megarl.rollout.vllm_worker_ext\n"
            "print(len(calls))\n")
    env = {k: v for k, v in os.environ.items() if k != REQUEST_ENV}
    if value:
        env[REQUEST_ENV] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(calls)
