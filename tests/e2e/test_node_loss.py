"""A node lost mid-run, on hosts made of network namespaces (tests/cluster_hosts.py): its link is set down and every
process on it stopped (SIGSTOP), as a host that hangs or drops off the network leaves them: no FIN, no reset, the
peers' packets go nowhere.

- An engine node lost (the trainer on node01, an engine as its own command on each of node02 and node03; node03
  lost): the trainer cannot restart an engine another node started, so it drops it within
  rollout.health_interval_s + rollout.health_timeout_s + rollout.publish_timeout_s of the loss
  (megarl/rollout/supervisor.py), and the run trains to its last step on node02's engine, no trajectory twice.
- A trainer follower's node lost (`megarl launch --launcher torchrun --nodes 2`, node02 lost): trainer rank 0's next
  collective with it fails after trainer.collective_timeout_s (megarl/trainer/parallel.py), the launch on node01
  ends naming the cause and the key, the newest complete checkpoint stands (logging.save_every=1), and once node02
  is back the same launches with logging.resume go on from it to the last step, the steps contiguous.

Both run on one bring-up of three hosts.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from cluster_hosts import _ip, _kill_netns_pids, cluster
from conftest import ROOT
from test_multihost import KEYS, _wait, megarl_env
from test_resume import jsonl

from megarl.checkpoint.dirs import list_checkpoints
from megarl.checkpoint.files import verify_checkpoint

pytestmark = pytest.mark.e2e
PY = sys.executable
RUN_ARGS = ["--gpus-per-node", "0", "--config", "configs/tiny_cpu.yaml", "rollout.backend=hf", "trainer.batch_size=32",
            "rollout.group_size=8", "logging.progress=none", "logging.tensorboard=false", "eval.path="]
#: the engine case's bounds: an engine silent this long after its loss is dropped (module doc)
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, PUBLISH_TIMEOUT_S = 1.0, 2.0, 5.0
ENGINE_BOUND_S = HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S + PUBLISH_TIMEOUT_S
ENGINE_STEPS = 10
#: the trainer case's bound: rank 0's next collective with the lost rank fails this long after it began
COLLECTIVE_TIMEOUT_S = 20.0
#: what may come on top of it: the time to rank 0's next collective (a step here) and the exit of every process
STOP_MARGIN_S = 30.0
TRAINER_STEPS = 6


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    shared = tmp_path_factory.mktemp("node_loss")
    with cluster(3, shared, names=["node01", "node02", "node03"]) as c:
        yield c, shared


def _launch(c, shared, host: str, name: str, args: list[str]) -> tuple[subprocess.Popen, object]:
    log = shared / f"{name}.{host}.log"
    p = c.popen(host, [PY, "-m", "megarl.cli", "launch", "--launcher", "torchrun", *args], cwd=ROOT,
                env=megarl_env(**KEYS), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return p, log


def _veth(c, host: str) -> str:
    return f"{c.tag}v{c.hosts.index(c.host(host)) + 1}"


def _pids(c, host: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", c.host(host).ns, check=False).stdout.split()]


def lose(c, host: str) -> float:
    """``host`` is lost: its link down, every process on it stopped; returns the moment it began (monotonic)."""
    t0 = time.monotonic()
    _ip("link", "set", _veth(c, host), "down")
    for pid in _pids(c, host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    return t0


def bring_back(c, host: str, procs: list[subprocess.Popen]) -> None:
    """``host`` comes back as a rebooted node does: what ran on it is gone (killed), its link up again."""
    _kill_netns_pids(c.host(host).ns)
    for p in procs:
        p.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _pids(c, host):
        assert time.monotonic() < deadline, f"processes left on {host}: {_pids(c, host)}"
        time.sleep(0.1)
    _ip("link", "set", _veth(c, host), "up")


def _seen(log, text: str, deadline: float) -> float | None:
    """The moment ``text`` appears in ``log`` (polled every 0.1 s), or None at ``deadline``."""
    while time.monotonic() < deadline:
        if text in log.read_text():
            return time.monotonic()
        time.sleep(0.1)
    return None


def _trained_once(run, steps: int) -> None:
    lines = jsonl(run / "trained_ids.jsonl")
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    trained = [i for r in lines for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == steps * 32, "a trajectory was trained twice"


def test_an_engine_node_lost_is_dropped_within_its_bound_and_the_run_goes_on(hosts, ckpt):
    c, shared = hosts
    run = shared / "engine_loss"
    args = ["--nodes", "3", *RUN_ARGS, f"model.checkpoint={ckpt}", f"logging.output_dir={run}",
            "placement.engine_nodes=2", "rollout.n_engines=2", f"trainer.total_steps={ENGINE_STEPS}",
            f"rollout.health_interval_s={HEALTH_INTERVAL_S}", f"rollout.health_timeout_s={HEALTH_TIMEOUT_S}",
            f"rollout.publish_timeout_s={PUBLISH_TIMEOUT_S}", "logging.save_every=0"]
    started = {h: _launch(c, shared, h, "engine_loss", args) for h in ("node02", "node03", "node01")}
    procs = {h: p for h, (p, _) in started.items()}
    logs = {h: log for h, (_, log) in started.items()}
    trainer_log = logs["node01"]
    _wait(lambda: len(jsonl(run / "metrics.jsonl")) >= 2, list(procs.values()), logs, "step 2", 300)
    assert jsonl(run / "metrics.jsonl")[-1]["n_engines_live"] == 2
    t0 = lose(c, "node03")  # engine1 (the plan puts engine i on engine node i)
    t_drop = _seen(trainer_log, "engine 1 dropped", t0 + ENGINE_BOUND_S + 60)
    assert t_drop is not None, f"engine 1 not dropped in {ENGINE_BOUND_S + 60:g} s: {trainer_log.read_text()[-3000:]}"
    drop_s = t_drop - t0
    step_at_drop = len(jsonl(run / "metrics.jsonl"))
    print(f"engine node lost: dropped after {drop_s:.1f} s (bound {ENGINE_BOUND_S:g} s) at step {step_at_drop}")
    _wait(lambda: procs["node01"].poll() is not None, [procs["node01"]], logs, "the trainer's end", 300)
    procs["node02"].send_signal(signal.SIGTERM)  # the live engine node's launch serves until it is stopped
    procs["node02"].wait(timeout=60)
    bring_back(c, "node03", [procs["node03"]])
    text = trainer_log.read_text()
    assert [procs["node01"].returncode, procs["node02"].returncode] == [0, 75], text[-3000:]
    assert drop_s <= ENGINE_BOUND_S, f"dropped {drop_s:.1f} s after the loss, bound {ENGINE_BOUND_S:g} s"
    assert re.search(r"engine 1 failed: (no /health answer within|request .* failed|weight update not done)", text)
    assert "engine 1 dropped after 0 restart attempt(s); 1 engine(s) left" in text
    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, ENGINE_STEPS + 1))
    assert [r["n_engines_live"] for r in metrics][-1] == 1
    assert step_at_drop < ENGINE_STEPS, "the run ended before the drop: nothing trained with one engine"
    _trained_once(run, ENGINE_STEPS)


def test_a_trainer_node_lost_stops_the_run_within_its_bound_and_it_resumes(hosts, ckpt):
    c, shared = hosts
    run = shared / "trainer_loss"
    args = ["--nodes", "2", *RUN_ARGS, f"model.checkpoint={ckpt}", f"logging.output_dir={run}",
            "placement.trainer_nodes=2", f"trainer.total_steps={TRAINER_STEPS}", "logging.save_every=1",
            f"trainer.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"]
    first = {h: _launch(c, shared, h, "trainer_loss", args) for h in ("node01", "node02")}
    procs = {h: p for h, (p, _) in first.items()}
    logs = {h: log for h, (_, log) in first.items()}
    ckpts = run / "checkpoints"
    _wait(lambda: len(jsonl(run / "metrics.jsonl")) >= 2 and any(s >= 2 for s, _ in list_checkpoints(ckpts)),
          list(procs.values()), logs, "step 2's checkpoint", 300)
    saved = list_checkpoints(ckpts)[-1][0]
    reached = len(jsonl(run / "metrics.jsonl"))
    t0 = lose(c, "node02")
    bound = COLLECTIVE_TIMEOUT_S + STOP_MARGIN_S
    try:
        procs["node01"].wait(timeout=bound + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node01's launch still runs {bound + 60:g} s after node02 was lost: "
                    f"{logs['node01'].read_text()[-3000:]}")
    stop_s = time.monotonic() - t0
    text = logs["node01"].read_text()
    last = [line for line in text.splitlines() if line.strip()][-1]
    print(f"trainer node lost at step {reached} (checkpoint {saved}): node01's launch exited with "
          f"{procs['node01'].returncode} after {stop_s:.1f} s (bound {bound:g} s); its last line: {last}")
    assert stop_s <= bound, f"node01's launch ran {stop_s:.1f} s after the loss, bound {bound:g} s"
    assert procs["node01"].returncode == 1, text[-3000:]
    assert (f"waited trainer.collective_timeout_s={COLLECTIVE_TIMEOUT_S:g} s in a collective for another trainer "
            f"rank") in text, text[-3000:]
    assert "a trainer node was lost" in text and f"logging.resume={run}" in text
    assert last == "[megarl launch] trainer.node0 failed with exit code 1; stopping the run"
    newest, newest_dir = list_checkpoints(ckpts)[-1]
    verify_checkpoint(newest_dir)  # complete: every file its manifest lists, as written
    assert saved <= newest <= len(jsonl(run / "metrics.jsonl")), (saved, newest)

    bring_back(c, "node02", [procs["node02"]])
    resumed = {h: _launch(c, shared, h, "trainer_resume", [*args, f"logging.resume={run}"])
               for h in ("node01", "node02")}
    procs2 = {h: p for h, (p, _) in resumed.items()}
    logs2 = {h: log for h, (_, log) in resumed.items()}
    _wait(lambda: all(p.poll() is not None for p in procs2.values()), list(procs2.values()), logs2,
          "the resumed run's end", 300)
    assert [p.returncode for p in procs2.values()] == [0, 0], {h: log.read_text()[-3000:] for h, log in logs2.items()}
    assert [(r["attempt"], r["step"]) for r in jsonl(run / "resumes.jsonl")] == [(1, newest)]
    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, TRAINER_STEPS + 1))
    assert [r["version"] for r in metrics] == list(range(1, TRAINER_STEPS + 1))
    _trained_once(run, TRAINER_STEPS)
