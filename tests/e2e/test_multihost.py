"""megarl across hosts made of network namespaces on one machine (tests/cluster_hosts.py)."""
import os
import sys

import pytest
from cluster_hosts import cluster
from conftest import ROOT

pytestmark = pytest.mark.e2e
PY = sys.executable


def megarl_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MEGARL_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", **extra)
    return env


def test_a_trainer_node_named_loopback_is_refused_before_anything_starts(ckpt, tmp_path):
    """The hosts-file trap: node01 maps its own name to 127.0.1.1. `megarl launch` there refuses the two-node
    plan at once, naming placement.master_addr with node01's address, and starts no process (without the check,
    torchrun starts and waits for node02, which never comes: a timeout here)."""
    with cluster(2, tmp_path / "shared", names=["node01", "node02"], trap="node01") as c:
        r = c.run("node01", [PY, "-m", "megarl.cli", "launch", "--launcher", "torchrun", "--nodes", "2",
                             "--gpus-per-node", "0", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}",
                             "placement.trainer_nodes=2", f"logging.output_dir={tmp_path / 'shared' / 'run'}"],
                  timeout=90, cwd=ROOT, env=megarl_env(MEGARL_WORLD_KEY="k" * 32))
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "'node01' resolves to a loopback address on this node" in r.stderr
        assert f"set placement.master_addr={c.host('node01').addr}" in r.stderr
        assert "[megarl launch]" not in r.stderr and "torch.distributed.run" not in r.stdout + r.stderr
