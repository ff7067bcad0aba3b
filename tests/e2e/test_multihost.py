"""megarl across hosts made of network namespaces on one machine (tests/cluster_hosts.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cluster_hosts import cluster
from conftest import ROOT
from test_resume import jsonl

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


KEYS = {"MEGARL_WORLD_KEY": "w" * 48, "MEGARL_ENGINE_KEY": "e" * 48, "MEGARL_DEDICATED_AUTHKEY": "d" * 32}
STEPS = 3
RUN_ARGS = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32", "rollout.group_size=8",
            "logging.progress=none", "logging.tensorboard=false", "eval.path=", "logging.save_every=0",
            f"trainer.total_steps={STEPS}", "rollout.weight_sync=broadcast", "recovery.name=dedicated"]
THREE_NODES = ["--launcher", "torchrun", "--nodes", "3", "--gpus-per-node", "0", *RUN_ARGS, "placement.trainer_nodes=2",
               "placement.engine_nodes=1", "placement.dedicated_command=true"]


def _wait(cond, procs, logs, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        done = [p for p in procs if p.poll() is not None and p.returncode != 0]
        tails = {h: log.read_text()[-2500:] for h, log in logs.items()}
        assert not done, f"a launch failed ({[p.returncode for p in done]}) before {what}: {tails}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {tails}"
        time.sleep(0.5)


def test_three_hosts_torchrun_broadcast_scorer_and_a_stranger(ckpt, tmp_path):
    """Two trainer ranks on node01/node02 (torchrun's c10d rendezvous across hosts, rank 0 on node01), the engine
    on node03 reached over the bridge, weights broadcast across hosts (gloo), the dedicated scorer as its own
    command on node01; a fourth host without the run's keys is refused by each listener while the run goes on."""
    shared = tmp_path / "shared"
    run = shared / "run"
    with cluster(4, shared, names=["node01", "node02", "node03", "node04"]) as c:
        env = megarl_env(**KEYS)
        logs, procs = {}, []
        for host in ("node03", "node01", "node02"):  # each node runs its own `megarl launch` (launch/torchrun.sh)
            logs[host] = shared / f"launch.{host}.log"
            procs.append(c.popen(host, [PY, "-m", "megarl.cli", "launch", *THREE_NODES,
                                        f"model.checkpoint={ckpt}", f"logging.output_dir={run}"],
                                 cwd=ROOT, env=env, stdout=open(logs[host], "w"), stderr=subprocess.STDOUT))
        try:
            _wait(lambda: len(jsonl(run / "metrics.jsonl")) >= 1, procs, logs, "the first trained step", 300)
            targets = ["node03:8100", "node01:29600", "node01:8100"]
            stranger = c.run("node04", [PY, str(ROOT / "tests" / "e2e" / "stranger_probe.py"), *targets],
                             timeout=60, cwd=ROOT, env=megarl_env())
            _wait(lambda: all(p.poll() is not None for p in procs[1:]), procs[1:], logs, "the trainer's end", 300)
            procs[0].send_signal(signal.SIGTERM)  # the engine node's launch serves until it is stopped
            procs[0].wait(timeout=60)
        finally:
            texts = {h: log.read_text() for h, log in logs.items()}
        assert [p.returncode for p in procs] == [75, 0, 0], {h: t[-3000:] for h, t in texts.items()}
    report = json.loads(stranger.stdout)
    print("stranger:", json.dumps(report))
    assert report["refused"] == report["attempts"] == 6, report
    assert report["seconds"] < 30, report  # no listener kept it waiting
    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    # the engine on node03 samples with the weights broadcast from node01; the dedicated scorer on node01 scores
    # the same tokens with the trainer's saved versions: fp32 log-probs of two processes, summed in another order
    gaps = [r["abs_logp_anchor_minus_behav_mean"] for r in metrics]
    print("anchor-behav gaps:", gaps)
    assert max(gaps) < 1e-5, gaps
    assert "starting trainer.node0" in texts["node01"] and "starting dedicated" in texts["node01"]
    assert "starting trainer.node1" in texts["node02"] and "starting engine0" in texts["node03"]
