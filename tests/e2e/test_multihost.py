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


def test_master_addr_on_another_host_than_trainer_rank_0_is_refused_before_anything_starts(ckpt, tmp_path):
    """placement.master_addr names node02, but torchrun's node-rank 0 (trainer rank 0) runs on node01: the launch
    on each trainer node refuses at once, naming the key (without the check, torchrun on node01 serves the
    rendezvous where node02 does not look, and both wait for its timeout: a timeout here)."""
    with cluster(2, tmp_path / "shared", names=["node01", "node02"]) as c:
        addr = c.host("node02").addr
        for host, says in (("node01", "is not an address of this node (node01)"),
                           ("node02", "is an address of this node (node02), but trainer rank 0 runs on")):
            r = c.run(host, [PY, "-m", "megarl.cli", "launch", "--launcher", "torchrun", "--nodes", "2",
                             "--gpus-per-node", "0", "--config", "configs/tiny_cpu.yaml", f"model.checkpoint={ckpt}",
                             "placement.trainer_nodes=2", f"placement.master_addr={addr}",
                             f"logging.output_dir={tmp_path / 'shared' / 'run'}"],
                      timeout=60, cwd=ROOT, env=megarl_env(MEGARL_WORLD_KEY="k" * 32))
            assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
            assert f"placement.master_addr={addr} {says}" in r.stderr, r.stderr[-2000:]
            assert "torch.distributed.run" not in r.stdout + r.stderr


KEYS = {"MEGARL_WORLD_KEY": "w" * 48, "MEGARL_ENGINE_KEY": "e" * 48, "MEGARL_DEDICATED_AUTHKEY": "d" * 32}
#: enough that the stranger's probe (a few seconds) ends while the run still trains
STEPS = 8
RUN_ARGS = ["--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32", "rollout.group_size=8",
            "logging.progress=none", "logging.tensorboard=false", "eval.path=", "logging.save_every=0",
            f"trainer.total_steps={STEPS}", "rollout.weight_sync=broadcast", "recovery.name=dedicated",
            "rollout.eta=0"]  # synchronous: a batch holds the same groups whatever the timing (the single-host twin)
THREE_NODES = ["--launcher", "torchrun", "--nodes", "3", "--gpus-per-node", "0", *RUN_ARGS, "placement.trainer_nodes=2",
               "placement.engine_nodes=1", "placement.dedicated_command=true"]


def test_an_engine_node_named_loopback_is_refused_before_anything_starts(ckpt, tmp_path):
    """The hosts-file trap on the engine's node: `megarl launch` on node02 refuses the plan at once, naming
    placement.server_addresses.node02 with node02's address, and starts no engine; the engine role started any
    other way (its own `python -m megarl.train`) refuses too, before it loads anything. Without the check, the
    engine serves on every interface and the launch waits for its stop: a timeout here."""
    with cluster(2, tmp_path / "shared", names=["node01", "node02"], trap="node02") as c:
        fix = f"set placement.server_addresses.node02={c.host('node02').addr}"
        env = megarl_env(**KEYS)
        r = c.run("node02", [PY, "-m", "megarl.cli", "launch", "--launcher", "torchrun", "--nodes", "2",
                             "--gpus-per-node", "0", *RUN_ARGS, f"model.checkpoint={ckpt}", "placement.engine_nodes=1",
                             f"logging.output_dir={tmp_path / 'shared' / 'run'}"], timeout=60, cwd=ROOT, env=env)
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "'node02' resolves to a loopback address on this node" in r.stderr and fix in r.stderr, r.stderr
        assert "starting engine0" not in r.stdout + r.stderr
        role = {"MEGARL_ROLE": "engine", "MEGARL_SERVER_HOST": "node02", "MEGARL_CONTROLLER_HOST": "node01",
                "MEGARL_SERVER_PORT": "8100"}
        r = c.run("node02", [PY, "-m", "megarl.train", *RUN_ARGS, f"model.checkpoint={ckpt}"], timeout=60, cwd=ROOT,
                  env={**env, **role})
        assert r.returncode == 2 and fix in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


#: megarl's agent endpoint (megarl/agents/http_server.py) on the address given, as `agent.http_host` exposes it to
#: the cluster network, with one episode open and a service key; writes "port key" to the file given once it listens
AGENT_ENDPOINT = """
import asyncio, os, sys
from megarl.agents.http_server import AgentHttpServer

async def main(host, out):
    server = AgentHttpServer(host=host, port=0, model="policy", service_key=os.urandom(24).hex())
    await server.start()
    session = server.open_session(client=None)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{server.port} {session.key}")
    os.replace(tmp, out)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_stranger_gets_nothing_from_an_agent_endpoint_on_the_cluster_network(tmp_path):
    """The agent endpoint listening on node01's cluster address (agent.http_host): node04, without the run's keys,
    tries completions without a key, with an OpenAI-shaped one and with one shaped like an episode's, to claim an
    episode without the service key and to report a reward: each is refused (401) within its deadline. The episode's
    key holder on node04 is answered, so the refusals are the endpoint's, not the network's."""
    shared = tmp_path / "shared"
    with cluster(2, shared, names=["node01", "node04"]) as c:
        addr, out = c.host("node01").addr, shared / "agent_endpoint"
        server = c.popen("node01", [PY, "-c", AGENT_ENDPOINT, addr, str(out)], cwd=ROOT, env=megarl_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not out.exists():
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1][-2000:]
            time.sleep(0.1)
        port, key = out.read_text().split()
        stranger = c.run("node04", [PY, str(ROOT / "tests" / "e2e" / "stranger_probe.py"), "-", "-", "-",
                                    f"{addr}:{port}"], timeout=60, cwd=ROOT, env=megarl_env())
        holder = c.run("node04", [PY, "-c", "import sys, urllib.request as u; r = u.urlopen(u.Request(sys.argv[1], "
                                  "headers={'Authorization': 'Bearer ' + sys.argv[2]}), timeout=5); "
                                  "print(r.status, r.read().decode())", f"http://{addr}:{port}/v1/models", key],
                       timeout=60, cwd=ROOT, env=megarl_env())
        assert server.poll() is None, "the endpoint ended under the stranger's requests"
    assert stranger.returncode == 0, stranger.stderr[-2000:]
    report = json.loads(stranger.stdout)
    print("stranger at the agent endpoint:", json.dumps(report))
    assert report["targets"]["agent"]["results"] == ["refused 401"] * 5, report
    assert report["refused"] == report["attempts"] == 5 and report["seconds"] < 30, report
    assert holder.returncode == 0 and holder.stdout.startswith("200 ") and '"policy"' in holder.stdout, holder


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
    command on node01; a fourth host without the run's keys is refused by each listener while the run goes on.
    node03 has the hosts-file trap (its own name at 127.0.1.1): placement.server_addresses gives it its address,
    where the engine listens and the trainer connects."""
    shared = tmp_path / "shared"
    run = shared / "run"
    with cluster(4, shared, names=["node01", "node02", "node03", "node04"], trap="node03") as c:
        env = megarl_env(**KEYS)
        engine_addr = f"placement.server_addresses.node03={c.host('node03').addr}"
        logs, procs = {}, []
        for host in ("node03", "node01", "node02"):  # each node runs its own `megarl launch` (launch/torchrun.sh)
            logs[host] = shared / f"launch.{host}.log"
            procs.append(c.popen(host, [PY, "-m", "megarl.cli", "launch", *THREE_NODES, engine_addr,
                                        f"model.checkpoint={ckpt}", f"logging.output_dir={run}"],
                                 cwd=ROOT, env=env, stdout=open(logs[host], "w"), stderr=subprocess.STDOUT))
        # the stranger loads while the run starts and probes right after the first step: a step takes about half
        # a second here, and loading the probe (a few seconds) after that step left some runs at their end
        targets = ["node03:8100", "node01:29600", "node01:8100"]
        probe = c.popen("node04", [PY, str(ROOT / "tests" / "e2e" / "stranger_probe.py"), "--on-stdin", *targets],
                        cwd=ROOT, env=megarl_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert probe.stdout.readline().strip() == "ready"
            _wait(lambda: len(jsonl(run / "metrics.jsonl")) >= 1, procs, logs, "the first trained step", 300)
            out, _ = probe.communicate("go\n", timeout=60)
            stranger = subprocess.CompletedProcess(probe.args, probe.returncode, out, "")
            # the listeners it met were the run's: every process still runs, short of the last step
            running = [p.poll() is None for p in procs] + [len(jsonl(run / "metrics.jsonl")) < STEPS]
            _wait(lambda: all(p.poll() is not None for p in procs[1:]), procs[1:], logs, "the trainer's end", 300)
            procs[0].send_signal(signal.SIGTERM)  # the engine node's launch serves until it is stopped
            procs[0].wait(timeout=60)
        finally:
            texts = {h: log.read_text() for h, log in logs.items()}
        assert [p.returncode for p in procs] == [75, 0, 0], {h: t[-3000:] for h, t in texts.items()}
    report = json.loads(stranger.stdout)
    print("stranger:", json.dumps(report))
    assert running == [True] * 4, f"the run ended before the stranger's probe did: {report}"
    assert report["refused"] == report["attempts"] == 6, report
    assert not [r for t in report["targets"].values() for r in t["results"] if "ConnectionRefused" in r or
                r == "refused connection"], f"a listener was not there: {report}"
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
    assert_single_host_twin(ckpt, tmp_path / "single", run, env)


#: what a step's training computed, compared to the bit with the single-host twin
TWIN_KEYS = ("loss", "grad_norm", "reward_mean")


def assert_single_host_twin(ckpt, single, run, env) -> None:
    """The same config on one host (both trainer ranks, the engine and the scorer on this machine) trains the
    same steps to the bit: synchronous (rollout.eta=0), each batch holds the same groups whatever the timing, and
    every request's seed comes from its trajectory's id, so the hosts (the gloo collectives across the bridge, the
    weights broadcast to another host) are all that differ."""
    from safetensors.torch import load_file

    r = subprocess.run([PY, "-m", "megarl.cli", "launch", "--launcher", "torchrun", *RUN_ARGS,
                        "placement.trainer_ranks=2", "placement.dedicated_command=true", f"model.checkpoint={ckpt}",
                        f"logging.output_dir={single}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    hosts, twin = jsonl(run / "metrics.jsonl"), jsonl(single / "metrics.jsonl")
    print("three hosts:", [[m[k] for k in TWIN_KEYS] for m in hosts])
    assert [[m[k] for k in TWIN_KEYS] for m in hosts] == [[m[k] for k in TWIN_KEYS] for m in twin], \
        [[m[k] for k in TWIN_KEYS] for m in twin]
    a, b = (load_file(d / "final" / "model.safetensors") for d in (run, single))
    assert a.keys() == b.keys() and [k for k in a if not a[k].equal(b[k])] == [], "final weights differ"
