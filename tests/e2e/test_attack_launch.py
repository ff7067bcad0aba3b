"""An agent command that attacks the run it is part of, through `megarl launch --launcher torchrun` with two
trainer ranks, the dedicated scorer as its own command and rollout.workflow=agent_http.

Every episode's command (tests/e2e/attack_agent.py, tests/unit/attacker.py) tries, for real, before it answers:
to open the run's checkpoints for writing and list them, to plant a file in the source tree and in the Python
environment, to write the stop marker (which would turn the run's end into exit 75, a requeue), to read the
checkpoint key, to write a key into the trainer world's store (torchrun's, on the run's placement.master_port),
and to find one of the run's secrets in its environment or any /proc/<pid>/environ. Another user (uid 65534)
tries to read the run directory. Every attempt fails, the run stops on SIGTERM with 75, resumes from its own
checkpoint (no checkpoint refused as unsigned or damaged) and ends with 0.

The run directory lies under /var/tmp, not /tmp: an isolated command gets a fresh /tmp, which would hide it
whether or not the run protects it.
"""
import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from conftest import ENV, ROOT
from test_preempt_torchrun import finish, start
from test_resume import jsonl, wait_for

from megarl.rollout.client import free_port

TOTAL = 4
KEYS = {"MEGARL_ENGINE_KEY": "7c0ffee5a11c3d2b4a69807f6e5d4c3b",
        "MEGARL_DEDICATED_AUTHKEY": "a5e3d2c1b0a99887766554433"}


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="megarl-attack-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def other_user_reads(path: Path) -> str:
    """What uid 65534 gets trying to list ``path`` (a directory) or read it (a file)."""
    cmd = "import os, sys; p = sys.argv[1]; print(os.listdir(p) if os.path.isdir(p) else open(p).read()[:20])"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-I", "-c",
                        cmd, str(path)], capture_output=True, text=True, timeout=60)
    return "done" if r.returncode == 0 else r.stderr.strip().splitlines()[-1]


def test_an_attacking_agent_reaches_nothing_and_the_run_resumes(text_ckpt, base):
    run, reports, plan_file = base / "run", base / "reports", base / "plan.json"
    reports.mkdir()
    master_port = free_port()
    plan_file.write_text(json.dumps({
        "write": [str(ROOT / "megarl"), sysconfig.get_paths()["purelib"]],
        "overwrite": [str(run / "checkpoints" / "step_1" / "controller.pt"), str(run / "stop.json")],
        "read": [str(run / "checkpoints"), str(run / ".megarl-run" / "checkpoint.key")],
        "store": ["127.0.0.1", master_port], "secrets": list(KEYS.values())}))
    scorer_port = free_port()
    common = ["launch", "--launcher", "torchrun", "--config", "configs/tiny_agent_cpu.yaml", "rollout.backend=hf",
              "rollout.workflow=agent_http", "agent.tools=[]", "eval.path=", "logging.progress=none",
              "logging.tensorboard=false", "logging.save_every=1", "placement.trainer_ranks=2",
              f"placement.master_port={master_port}", "recovery.name=dedicated", "placement.dedicated_command=true",
              f"placement.engine_port={scorer_port}", f"model.checkpoint={text_ckpt}", f"trainer.total_steps={TOTAL}",
              f"agent.command={sys.executable} tests/e2e/attack_agent.py {reports} {plan_file}",
              f"agent.command_writable=[{reports}]"]
    env = {**ENV, **KEYS}

    log1 = base / "attempt1.log"
    first = start([*common, f"logging.output_dir={run}"], log1, env)
    wait_for(lambda: len(jsonl(run / "metrics.jsonl")) >= 2 and list(reports.glob("attack_*.json")), first, log1)
    # another user of a shared filesystem: the run directory is 0700, its files 0600
    outside = {p: other_user_reads(p) for p in (run, run / "metrics.jsonl")}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (run, run / "metrics.jsonl", run / "config.yaml")}
    first.send_signal(signal.SIGTERM)
    assert finish(first, log1) == 75, log1.read_text()[-3000:]

    log2 = base / "attempt2.log"
    second = start([*common, f"logging.resume={run}"], log2, env)
    assert finish(second, log2, timeout=300) == 0, log2.read_text()[-3000:]

    found = [json.loads(p.read_text()) for p in reports.glob("attack_*.json")]
    print(f"\n{len(found)} attacking episodes; another user: {outside}; modes {modes}")
    assert len(found) >= 8
    for r in found:
        attempts = {k: v for k, v in r.items() if k not in ("scratch /tmp", "env", "secrets")}
        assert len(attempts) == 8, r
        assert not [k for k, v in attempts.items() if v.startswith("done")], r
        assert r["scratch /tmp"] == "done" and r["env"] == [] and r["secrets"] == [], r
    assert all("Permission denied" in v for v in outside.values()), outside
    assert modes == {"run": "0o700", "metrics.jsonl": "0o600", "config.yaml": "0o600"}, modes
    text = log1.read_text() + log2.read_text()
    assert "not signed" not in text and "damaged" not in text and "planted" not in text, text[-3000:]
    resumed = [r["step"] for r in jsonl(run / "resumes.jsonl")]
    assert len(resumed) == 1 and resumed[0] >= 2, resumed
    assert [r["step"] for r in jsonl(run / "metrics.jsonl")] == list(range(1, TOTAL + 1))
    assert not (run / "stop.json").exists()
