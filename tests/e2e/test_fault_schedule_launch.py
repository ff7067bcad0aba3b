"""The run's defences together, through `megarl launch --launcher torchrun` with 2 trainer ranks, the dedicated
scorer, the HF engine and an agent command in another process (rollout.workflow=agent_http) that attacks the run it
is part of (tests/e2e/attack_agent.py, tests/unit/attacker.py). Every episode's command tries, for real, before it
answers: to plant a file in the run's checkpoints, the source tree and the Python environment, to write the stop
marker (which would turn the run's end into exit 75, a requeue) and the run's config, to list the checkpoints and
read the checkpoint key, to write a key into the trainer world's store (torchrun's, on placement.master_port), to
remount / writable, and to find one of the run's keys in its environment or any /proc/<pid>/environ. Another user
(uid 65534) tries to read the run directory. Every attempt fails.

The launching environment exports the run's two keys (MEGARL_ENGINE_KEY, MEGARL_DEDICATED_AUTHKEY) with values the
test knows, so that a key is recognised wherever it is found.

* attempt 1: after step 1 the engine is SIGSTOPped: it answers neither /health nor /generate. The health timeout is
  set above the /generate deadline (rollout.generate_timeout_s, megarl/rollout/generate_deadline.py), so that
  deadline takes it for wedged, or, when the stop lands while the staleness bound holds generation (no request in
  flight on it), the next publish's abort (a control call bounded by the health timeout) or the health check does:
  it is restarted (the stopped process is gone) and its requests are sent again. Two steps later, SIGTERM to
  `megarl launch`: exit 75 with a checkpoint of the step reached, rank 1 stopped with rank 0;
* attempt 2 (resumed): while it trains, no process of the run (the launch, torchrun's agent, both ranks, the
  engine and what they start) shows a key in /proc/<pid>/environ and rank 0 has deleted its key file
  (megarl/isolation/key_files.py); then SIGUSR1 to trainer rank 1 alone: the ranks agree at the step boundary, exit
  75 again, and the launch leaves no key directory;
* attempt 3 (resumed): to trainer.total_steps, exit 0.

Checked: every attempt ends within its timeout (no hang), metrics hold steps and versions 1..N, no trajectory is
trained twice, every trajectory accepted before the checkpoint an attempt stopped at is trained exactly once, the
engine restart is counted (n_engine_restarts, n_engine_resubmits), no checkpoint was refused as unsigned or damaged,
and no agent command reached anything: each ran in mount, network and PID namespaces of its own with its environment
scrubbed.

The run directory lies under /var/tmp, not /tmp: an isolated command gets a fresh /tmp, which would hide it whether
or not the run protects it.

The dedicated scorer runs as a command of its own on a port (placement.dedicated_command, the process layout of a
GPU node), and for the whole test a squatter holds idle connections to that port and tries a wrong key each
second: its connections are dropped at the handshake deadline and refused (the scorer's log says so) while the
trainer's link comes through, and no step waits for them.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import psutil
import pytest
from conftest import ENV, ROOT
from test_preempt_torchrun import checkpoints, finish, keys_in_environ, trainer_rank
from test_resume import jsonl, process_gone, wait_for

from megarl.rollout.client import free_port

#: enough steps that attempt 2's stop lands before the last one (a stop during the last step finishes the run)
TOTAL = 10
#: episodes per step (configs/tiny_agent_cpu.yaml has 16 in groups of 8): two groups of 4, so that each step starts
#: half as many isolated agent commands, each of which costs its namespaces' setup on a 2-core machine
BATCH, GROUP = 8, 4
KEYS = {"MEGARL_ENGINE_KEY": "5e1f0e7a11c3d2b4a69807f6e5d4c3b2", "MEGARL_DEDICATED_AUTHKEY": "d7c6b5a49382716050f4e3d2"}
#: the /generate deadline: far above what a request of this config takes on a loaded 2-core machine (a few
#: seconds), below the /health probe's own 60 s read limit, so that the deadline is what sees the stopped engine
GENERATE_TIMEOUT_S = 30
#: above the /generate deadline, so that the deadline sees the stopped engine first when it holds requests; it also
#: bounds the next publish's /abort_all, which sees it when it holds none
HEALTH_TIMEOUT_S = 40
#: how long attempt 1 may wait for the stopped engine's replacement: its deadline, the restart and a model load
RESTART_WITHIN_S = 150


def start(args, log, env):
    return subprocess.Popen([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, env=env, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


class Squatter(threading.Thread):
    """Holds idle connections to the scorer's port (one more each second, each closed after 20 s unread) and tries
    the wrong key once a second, for as long as the test runs: the run must not wait on any of them."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.idle, self.wrong_key = port, 0, 0
        self.halt = threading.Event()

    def run(self) -> None:
        held: list[tuple[float, socket.socket]] = []
        while not self.halt.wait(1.0):
            try:
                held.append((time.monotonic(), socket.create_connection(("127.0.0.1", self.port), timeout=1.0)))
                self.idle += 1
            except OSError:
                continue  # not listening (yet, or between attempts)
            for born, sock in [h for h in held if time.monotonic() - h[0] > 20.0]:
                sock.close()
                held.remove((born, sock))
            threading.Thread(target=self.try_wrong_key, daemon=True).start()
        for _, sock in held:
            sock.close()

    def try_wrong_key(self) -> None:
        try:
            Client(("127.0.0.1", self.port), authkey=b"not the run's key").close()
        except (OSError, EOFError, AuthenticationError):
            self.wrong_key += 1


def commands(procs) -> dict:
    """process -> its command line, for those still there."""
    out = {}
    for p in procs:
        try:
            out[p] = " ".join(p.cmdline())
        except psutil.Error:
            continue
    return out


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="megarl-faults-", dir="/var/tmp"))
    path.chmod(0o711)  # another user may pass through: what stops it is the run directory's own mode
    yield path
    shutil.rmtree(path, ignore_errors=True)


def attack_plan(run, master_port: int) -> dict:
    """What every agent command tries (tests/unit/attacker.py): the targets of each attempt."""
    return {"write": [str(run / "checkpoints"), str(ROOT / "megarl"), sysconfig.get_paths()["purelib"]],
            "overwrite": [str(run / "stop.json"), str(run / "config.yaml")],
            "read": [str(run / "checkpoints"), str(run / ".megarl-run" / "checkpoint.key")],
            "store": ["127.0.0.1", master_port], "secrets": list(KEYS.values())}


def other_user_reads(path: Path) -> str:
    """What uid 65534 gets trying to list ``path`` (a directory) or read it (a file)."""
    cmd = "import os, sys; p = sys.argv[1]; print(os.listdir(p) if os.path.isdir(p) else open(p).read()[:20])"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I", "-c",
                        cmd, str(path)], capture_output=True, text=True, timeout=60)
    return "done" if r.returncode == 0 else r.stderr.strip().splitlines()[-1]


def assert_nothing_reached(reports_dir) -> None:
    """No attacking agent command planted, overwrote, read or stored anything, nor saw a key or a job variable."""
    reports = [json.loads(p.read_text()) for p in reports_dir.glob("attack_*.json")]  # complete: written by a rename
    assert len(reports) >= 8, f"{len(reports)} agent commands reported"
    cut = len(list(reports_dir.glob(".attack_*.json.tmp")))  # stopped mid-write (a SIGTERM): counted, not read
    print(f"{len(reports)} attacking agent reports, {cut} cut short by a stop")
    for r in reports:
        attempts = {k: v for k, v in r.items() if k not in ("scratch /tmp", "env", "secrets")}
        assert len(attempts) == 9, r
        assert not [k for k, v in attempts.items() if v.startswith("done")], r
        assert r["scratch /tmp"] == "done" and r["env"] == [] and r["secrets"] == [], r


def accepted_total(run, step: int) -> int:
    """How many trajectories the run had accepted at step ``step``'s checkpoint (read before keep_last prunes it)."""
    return json.loads((run / "checkpoints" / f"step_{step}" / "manifest.json").read_text())["accepted_total"]


def assert_trained_once(journals, run) -> None:
    """Every trajectory accepted before the checkpoint each attempt stopped at is trained exactly once or waits in the
    final buffer; none is trained twice."""
    trained = [i for r in jsonl(run / "trained_ids.jsonl") for i in r["traj_ids"]]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert len(trained) >= TOTAL * BATCH  # an agent episode's turns may be trajectories of their own (ID.tN)
    accepted = [i for r in jsonl(run / "accepted.jsonl") for i in r["traj_ids"]]
    # the journal names an episode by its first trajectory's id, the later ones are ID.tN
    assert len(accepted) == len(set(accepted)) and {re.sub(r"\.t\d+$", "", i) for i in trained} <= set(accepted)
    from megarl.checkpoint.run_checkpoint import load_file

    buffer = load_file(run / "checkpoints" / f"step_{TOTAL}" / "controller.pt")["buffer"]
    waiting = [t["traj_id"] for g in buffer["ready"] for t in g["trajectories"]]  # accepted, left for a next step
    for journal, step, total in journals:
        before = [i for r in journal if r["accepted_total"] <= total for i in r["traj_ids"]]
        assert before, f"nothing accepted before step {step}'s checkpoint"
        twice = [i for i in before if trained.count(i) + waiting.count(i) != 1]
        assert not twice, f"accepted before step {step}'s checkpoint, not trained (or left waiting) exactly " \
                          f"once: {twice[:5]}"


def test_launch_torchrun_under_a_fault_schedule_loses_nothing_and_leaks_no_key(text_ckpt, base):
    run, reports, plan_file = base / "run", base / "reports", base / "plan.json"
    reports.mkdir()
    master_port = free_port()
    plan_file.write_text(json.dumps(attack_plan(run, master_port)))
    env = {**ENV, **KEYS}
    scorer_port = free_port()  # the scorer role's (placement.engine_port: no engine of this run takes a port)
    squatter = Squatter(scorer_port)
    squatter.start()
    common = ["launch", "--launcher", "torchrun", "--config", "configs/tiny_agent_cpu.yaml", "rollout.backend=hf",
              "rollout.workflow=agent_http", "agent.tools=[]", "eval.path=", "logging.progress=none",
              "logging.tensorboard=false", "logging.save_every=0", "placement.trainer_ranks=2",
              f"placement.master_port={master_port}", "recovery.name=dedicated", "placement.dedicated_command=true",
              f"placement.engine_port={scorer_port}", f"model.checkpoint={text_ckpt}", f"trainer.total_steps={TOTAL}",
              f"trainer.batch_size={BATCH}", f"rollout.group_size={GROUP}", "rollout.health_interval_s=1",
              f"rollout.health_timeout_s={HEALTH_TIMEOUT_S}",
              f"rollout.generate_timeout_s={GENERATE_TIMEOUT_S}",
              f"agent.command={sys.executable} tests/e2e/attack_agent.py {reports} {plan_file}",
              f"agent.command_writable=[{reports}]"]  # its reports; the rest of the filesystem is read-only to it

    # -- attempt 1: the engine stops answering after step 1, then SIGTERM to megarl launch
    log1 = base / "attempt1.log"
    first = start([*common, f"logging.output_dir={run}"], log1, env)
    wait_for(lambda: (run / "engine0.pid").is_file() and len(jsonl(run / "metrics.jsonl")) >= 1, first, log1)
    stopped = int((run / "engine0.pid").read_text())
    # another user of a shared filesystem: the run directory is 0700, its files 0600
    outside = {p: other_user_reads(p) for p in (run, run / "metrics.jsonl")}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (run, run / "metrics.jsonl", run / "config.yaml")}
    assert all("Permission denied" in v for v in outside.values()), outside
    assert modes == {"run": "0o700", "metrics.jsonl": "0o600", "config.yaml": "0o600"}, modes
    restarts_before = jsonl(run / "metrics.jsonl")[-1]["n_engine_restarts"]
    t_stop = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)
    try:
        wait_for(lambda: int((run / "engine0.pid").read_text() or stopped) != stopped, first, log1,
                 timeout=RESTART_WITHIN_S)
    finally:
        if not process_gone(stopped, timeout=0.1):
            os.kill(stopped, signal.SIGCONT)
    restart_s = time.monotonic() - t_stop
    assert process_gone(stopped), "the wedged engine was left running beside its replacement"
    at = len(jsonl(run / "metrics.jsonl"))
    wait_for(lambda: len(jsonl(run / "metrics.jsonl")) >= at + 2, first, log1)
    first.send_signal(signal.SIGTERM)
    assert finish(first, log1) == 75, log1.read_text()[-3000:]
    text = log1.read_text()
    # the squatter reached the scorer's listener: its idle connections were dropped at the handshake deadline and
    # its wrong key refused, while the trainer's own link came through (the run trained on)
    assert squatter.idle > 0 and squatter.wrong_key > 0, (squatter.idle, squatter.wrong_key)
    assert "dropped a connection that did not prove the key within" in text, text[-3000:]
    assert "refused a connection with the wrong key" in text, text[-3000:]
    # what took the stopped engine for wedged: the /generate deadline when requests were in flight on it, else
    # the next publish's abort (a control call within rollout.health_timeout_s), its drain deadline or the health
    # check
    assert re.search(r"engine 0 failed: .*(no answer to /generate within|/abort_all not done within|still running "
                     r".* after a publish aborted them|no /health answer within)", text), text[-3000:]
    metrics1 = jsonl(run / "metrics.jsonl")
    assert metrics1[-1]["n_engine_restarts"] >= restarts_before + 1, text[-3000:]
    assert sum(r["n_engine_resubmits"] for r in metrics1) > 0, "the wedged engine's requests were not sent again"
    k1 = checkpoints(run)[-1]
    assert k1 == len(metrics1) and not (run / "stop.json").exists()
    assert "rank 0 stopped the run (SIGUSR1" in text and "SIGKILL" not in text
    assert re.search(rf"the trainer stopped on SIGUSR1( on rank 1)? at step {k1} \(checkpointed\)", text), text[-2000:]
    journals = [(jsonl(run / "accepted.jsonl"), k1, accepted_total(run, k1))]
    assert k1 <= TOTAL - 3, f"attempt 1 stopped at step {k1}: attempt 2 would have no step to stop in (raise TOTAL)"

    # -- attempt 2: a signal that reaches only trainer rank 1
    log2 = base / "attempt2.log"
    second = start([*common, f"logging.resume={run}"], log2, env)
    wait_for(lambda: (run / "resumes.jsonl").exists() and len(jsonl(run / "metrics.jsonl")) >= k1 + 1, second, log2)
    # while it trains, no process of the run keeps a key in its environment (megarl/isolation/key_files.py)
    tree = commands(psutil.Process(second.pid).children(recursive=True))
    agents = [p for p, c in tree.items() if "torch.distributed.run" in c]
    assert len(agents) == 1 and sum("megarl.cli engine" in c for c in tree.values()) == 1, tree
    # the ranks are torchrun's own children (a rank's fork before an exec shows the rank's command line too)
    assert sum("-m megarl.train" in c for c in commands(agents[0].children()).values()) == 2, tree
    assert keys_in_environ(second, KEYS) == {}
    assert [f for d in run.glob(".megarl-keys-*") for f in d.iterdir()] == [], "rank 0 deletes its key file"
    reached = len(jsonl(run / "metrics.jsonl"))
    assert reached < TOTAL - 1, f"attempt 2 reached step {reached} before its stop: raise TOTAL"
    trainer_rank(second, 1).send_signal(signal.SIGUSR1)
    assert finish(second, log2) == 75, log2.read_text()[-3000:]
    assert list(run.glob(".megarl-keys-*")) == [], "the launch leaves no key directory, also when it stops"
    k2 = checkpoints(run)[-1]
    assert k2 > k1 and "SIGUSR1 on rank 1" in log2.read_text()
    journals.append((jsonl(run / "accepted.jsonl"), k2, accepted_total(run, k2)))

    # -- attempt 3: to the end (a stop may have landed on the last step: then it trains nothing)
    log3 = base / "attempt3.log"
    third = start([*common, f"logging.resume={run}"], log3, env)
    assert finish(third, log3, timeout=300) == 0, log3.read_text()[-3000:]
    assert list(run.glob(".megarl-keys-*")) == [], "the launch leaves no key directory"
    squatter.halt.set()
    print(f"\nlaunch x2 ranks: engine SIGSTOPped after step 1 replaced in {restart_s:.1f} s; SIGTERM at step {k1}; "
          f"rank-1 SIGUSR1 at step {k2}; {len(list(reports.glob('attack_*.json')))} attacking agent commands; "
          f"{squatter.idle} idle and {squatter.wrong_key} wrong-key connections to the scorer's port")

    metrics = jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, TOTAL + 1))
    assert [r["version"] for r in metrics] == list(range(1, TOTAL + 1)), "versions continue without a gap"
    assert [r["step"] for r in jsonl(run / "trained_ids.jsonl")] == list(range(1, TOTAL + 1))
    assert [r["step"] for r in jsonl(run / "resumes.jsonl")] == [k1, k2]
    assert_trained_once(journals, run)
    assert_nothing_reached(reports)
    text = log1.read_text() + log2.read_text() + log3.read_text()
    assert "not signed" not in text and "damaged" not in text and "planted" not in text, text[-3000:]
    assert (run / "final" / "model.safetensors").is_file()
