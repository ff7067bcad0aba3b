"""MegatronTrainer.save_state / load_state on 2 ranks: the resumed step is bitwise the uninterrupted one.

DP2 with the distributed optimizer (its parameter state is sharded over DP) and
TP2 (model and optimizer shards per rank), in float32 and in bf16 (where the
optimizer state holds the fp32 main params), and PP2 in bf16; see run_checkpoint.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.rollout.client import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt2")
    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", root / "dense", seed=3)
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(REPO / "tests/distributed/run_checkpoint.py"), "--checkpoint", str(ckpt), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out


@pytest.mark.parametrize("mode", ["dp2_distopt", "tp2", "dp2_distopt_bf16", "tp2_bf16", "pp2_bf16"])
def test_resumed_step_is_bitwise(results, mode):
    for rank in (0, 1):
        res = json.loads((results / f"{mode}.rank{rank}.json").read_text())
        assert res["version"] == 3 and res["max_diff"] == 0.0, (mode, rank, res)
    names = {p.name for p in (results / mode).iterdir()}  # the reshardable format (megarl/trainer/dist_state.py)
    assert {"megarl_trainer.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, sorted(names)
