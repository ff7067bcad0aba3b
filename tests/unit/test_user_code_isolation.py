"""Code the policy writes cannot touch the run (megarl/isolation/process_isolation.py, megarl/isolation/).

tests/unit/attacker.py makes each attempt for real, as an agent command and as sandboxed code: plant a file in
the source tree, the Python environment and a checkpoint; read the run's checkpoint key and a file of the run's
shared memory; list and write a trainer world's TCPStore; find rendezvous facts in its environment; remount the
filesystem writable. Isolated, every attempt fails while the agent endpoint and its own /tmp still work; the
same script run without isolation (the control) succeeds at each, so the attacker is not what fails.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from megarl.isolation import process_isolation
from megarl.isolation.run_key import checkpoint_key, key_path
from megarl.rewards.code import run_python
from megarl.workflows import agent_http
from megarl.workflows.agent_http import CommandLimits, run_command

REPO = Path(__file__).resolve().parents[2]
ATTACKER = Path(__file__).with_name("attacker.py")


@pytest.fixture
def run_world(tmp_path, monkeypatch):
    """A run directory with a checkpoint and its key, a file in shared memory, a trainer world's store, an agent
    endpoint, and the rendezvous variables a trainer rank has."""
    monkeypatch.setenv(process_isolation.PROTECTED_ENV, "")
    # outside /tmp, which isolated code gets fresh: the run directory is hidden by being protected, not by luck
    base = Path(tempfile.mkdtemp(prefix="megarl-test-", dir="/var/tmp"))
    run = base / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    checkpoint_key(run, create=True)
    process_isolation.protect(run)
    shm = Path("/dev/shm") / f"megarl-test-{uuid.uuid4().hex[:8]}"
    shm.write_bytes(b"weights")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    store.set("gloo/rank0", "127.0.0.1:12345")
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
                 "TORCHELASTIC_RUN_ID": "x", "MEGARL_STOP_MARKER": str(run / "stop.json")}.items():
        monkeypatch.setenv(k, v)
    endpoint = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [endpoint.accept()[0].close() for _ in range(10)], daemon=True).start()
    yield {"run": run, "shm": shm, "store": store, "endpoint": endpoint.getsockname()}
    shutil.rmtree(base)
    shm.unlink()
    endpoint.close()


def _plan(world, source: Path, venv: Path) -> dict:
    return {"write": [str(source), str(venv), str(world["run"] / "checkpoints" / "step_2")],
            "read": [str(key_path(world["run"])), str(world["shm"])], "store": ["127.0.0.1", world["store"].port],
            "endpoint": list(world["endpoint"])}


def _attack(plan: dict, limits: CommandLimits, endpoint) -> dict:
    out = asyncio.run(run_command([sys.executable, str(ATTACKER), json.dumps(plan)], {}, {}, 120.0, limits,
                                  tuple(endpoint)))
    return json.loads(out.strip().splitlines()[-1])


def test_an_isolated_agent_command_is_refused_every_attempt(run_world):
    plan = _plan(run_world, REPO / "megarl", Path(sysconfig.get_paths()["purelib"]))
    keys = run_world["store"].num_keys()
    seen = _attack(plan, CommandLimits(), run_world["endpoint"])
    attempts = {k: v for k, v in seen.items() if k not in ("endpoint", "scratch /tmp", "env", "secrets")}
    assert len(attempts) == 7 and not [k for k, v in attempts.items() if v.startswith("done")], seen
    assert "Read-only file system" in seen[f"write {REPO / 'megarl'}"], seen
    assert seen["endpoint"] == "done" and seen["scratch /tmp"] == "done", seen  # what it needs still works
    assert seen["env"] == [], seen  # no rendezvous fact, no stop marker path
    assert run_world["store"].num_keys() == keys and not run_world["store"].check(["planted"])  # saw nothing


def test_the_attacker_succeeds_without_isolation(run_world, tmp_path, monkeypatch):
    """The control: unisolated, the same script plants, reads, writes the store and sees the rendezvous facts
    (the source tree and the environment replaced by copies it may write, so nothing real is touched)."""
    monkeypatch.setattr(agent_http, "isolation_prefix", lambda *a, **k: ())
    source, venv = tmp_path / "source", tmp_path / "venv"
    source.mkdir()
    venv.mkdir()
    seen = _attack(_plan(run_world, source, venv), CommandLimits(allow_unisolated=True), run_world["endpoint"])
    assert all(v.startswith("done") for k, v in seen.items() if k not in ("env", "secrets", "remount /")), seen
    assert run_world["store"].check(["planted"])


def test_sandboxed_code_writes_its_directory_only(run_world, monkeypatch):
    """The code sandbox (the code reward, the python tool): the same filesystem, no network, its own directory
    writable; the run directory unprotected (the control), its key is read."""
    attacks = (f"open({str(REPO / 'megarl' / 'planted.py')!r}, 'w')",
               f"open({str(run_world['run'] / 'checkpoints' / 'step_2' / 'x')!r}, 'w')",
               f"open({str(key_path(run_world['run']))!r}).read()",
               f"__import__('socket').create_connection(('127.0.0.1', {run_world['store'].port}), timeout=5)")
    code = "results = []\n"
    for a in attacks:
        code += f"try:\n    {a}\n    results.append('done')\nexcept OSError as e:\n"
        code += "    results.append(type(e).__name__)\n"
    code += "open('mine.txt', 'w').write('x')\nprint(results, open('mine.txt').read())\n"
    out = run_python(code, time_limit_s=30)
    assert out.strip().splitlines()[-1] == "['OSError', 'PermissionError', 'PermissionError', 'OSError'] x", out
    monkeypatch.setenv(process_isolation.PROTECTED_ENV, "")
    out = run_python(code, time_limit_s=30)
    assert out.strip().splitlines()[-1] == "['OSError', 'OSError', 'done', 'OSError'] x", out
