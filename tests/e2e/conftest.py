"""What the e2e tests share: the real CLI as a subprocess and the tiny checkpoints, written once per session (runs
read them and write under their own run directories)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: what a new user's shell lacks: commands that start engines must not need them (rollout.kv_cache_gb,
#: rollout.cpu_threads and the --kv-cache-gb / --cpu-threads flags stand for them)
ENGINE_VARS = ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")


def env_without(*names: str) -> dict:
    """ENV with ``names`` removed."""
    return {k: v for k, v in ENV.items() if k not in names}


def run_megarl(*args, timeout=600, unset=()):
    """`megarl ARGS...` from the repo root, without the variables ``unset``; returns the CompletedProcess."""
    return subprocess.run([*MEGARL, *args], cwd=ROOT, env=env_without(*unset), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random tiny dense Qwen3 checkpoint written by `megarl init-checkpoint`."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    r = run_megarl("init-checkpoint", "--model", "configs/models/tiny_qwen3.yaml", "--output", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    """The tiny Qwen3 with the character-level ASCII tokenizer (long answers at random init: splicing)."""
    out = tmp_path_factory.mktemp("text_ckpt") / "tiny_text"
    r = run_megarl("init-checkpoint", "--model", "configs/models/tiny_qwen3_text.yaml", "--output", str(out))
    assert r.returncode == 0, r.stderr
    return out
