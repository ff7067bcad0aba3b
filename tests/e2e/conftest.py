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


def _init_checkpoint(tmp_path_factory, model: str):
    """A random tiny checkpoint of configs/models/MODEL.yaml written by `megarl init-checkpoint`."""
    out = tmp_path_factory.mktemp(model) / model
    r = run_megarl("init-checkpoint", "--model", f"configs/models/{model}.yaml", "--output", str(out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """The tiny dense Qwen3."""
    return _init_checkpoint(tmp_path_factory, "tiny_qwen3")


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    """The tiny Qwen3 with the character-level ASCII tokenizer (long answers at random init: splicing)."""
    return _init_checkpoint(tmp_path_factory, "tiny_qwen3_text")


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    """The tiny Qwen3-MoE of configs/models/tiny_qwen3_moe.yaml (2 MoE layers, 4 experts, top-2)."""
    return _init_checkpoint(tmp_path_factory, "tiny_qwen3_moe")


def assert_exact_fp32(name: str, s: dict) -> None:
    """A strategy of an fp32 verify run (engines and trainer in fp32) that claims exactness: measured exact
    against the reference, and the reference itself checked by the engine oracle (it reproduced every policy
    token's logp_behav within 1e-5), so a reference fed wrong inputs cannot pass."""
    assert s["claims_exact"] and s["measured_exact"] and s["max_abs_err"] <= 1e-5, (name, s)
    o = s["oracle"]
    assert o["judges"] and o["passed"] and o["max_abs_err"] <= 1e-5 and o["n_tokens"] >= s["n_tokens"] > 0, (name, o)
    assert not s["copy"]["is_copy"] and s["copy"]["telling_tokens"] > 0, (name, s["copy"])


def assert_namespaced(lines: list[dict], verl: bool = True) -> None:
    """Every metrics.jsonl key of a run has a dashboard namespace (megarl/loop/metric_names.py), and (``verl``) every
    verl equivalent the docs list names a metric the run logged."""
    from megarl.loop.metric_names import NAMESPACES, VERL_EQUIVALENTS, dashboard_name

    keys = {k for r in lines for k in r if k != "step"}
    lost = sorted(k for k in keys if dashboard_name(k).split("/", 1)[0] not in NAMESPACES)
    assert not lost, f"metrics without a namespace (add them to megarl/loop/metric_names.py): {lost}"
    assert not verl or set(VERL_EQUIVALENTS) <= {dashboard_name(k) for k in keys}
