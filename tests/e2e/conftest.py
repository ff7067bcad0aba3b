"""What the e2e tests share: the real CLI as a subprocess and one tiny checkpoint per test module."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEGARL = [sys.executable, "-m", "megarl.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_megarl(*args, timeout=600):
    """`megarl ARGS...` from the repo root; returns the CompletedProcess (output captured)."""
    return subprocess.run([*MEGARL, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random tiny dense Qwen3 checkpoint written by `megarl init-checkpoint`."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    r = run_megarl("init-checkpoint", "--model", "configs/models/tiny_qwen3.yaml", "--output", str(out))
    assert r.returncode == 0, r.stderr
    return out
