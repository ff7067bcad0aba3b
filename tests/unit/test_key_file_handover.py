"""`megarl launch` hands each command its keys in a file of its own (megarl/isolation/key_files.py).

The checks look at what the reading process itself gets and what is left on
disk and in /proc/<pid>/environ, never at the hand-over's own bookkeeping:
one private file per consumer, deleted by its single reader; a trainer
follower reads none (so it cannot take rank 0's); a missing file is one clear
error; the launch keeps no key in its environment and leaves no file behind,
also when a command fails before it reads its own.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.isolation.key_files import KeyFiles, child_env
from megarl.isolation.secret_env import SECRET_ENV_VARS, take_secret
from megarl.launch.engine_key_env import ensure_run_keys
from megarl.launch.role_commands import RoleCommand
from megarl.launch.runner import run_commands

REPO = Path(__file__).resolve().parents[2]
KEYS = {"MEGARL_ENGINE_KEY": "engine-key-31d7c0", "MEGARL_DEDICATED_AUTHKEY": "scorer-key-a81f22",
        "MEGARL_AGENT_SERVICE_KEY": "service-key-5e06b9d4", "MEGARL_STOP_KEY": "stop-key-90c4e1",
        "MEGARL_WORLD_KEY": "world-key-7d1e03"}
#: a process that takes its secrets as every `megarl train` role does, then says what it got and what /proc shows
TAKE = r"""
    import json, os, re
    from megarl.isolation.secret_env import SECRET_ENV_VARS, take_all_secrets, take_secret
    take_all_secrets()
    raw = open("/proc/self/environ", "rb").read()
    print(json.dumps({"got": {n: take_secret(n) for n in SECRET_ENV_VARS},
                      "env": sorted(k for k in os.environ if k.startswith("MEGARL_") and "KEY" in k),
                      "proc": [n for n in SECRET_ENV_VARS  # a value left readable (a wiped one is all x)
                               if re.search(rb"(^|\0)" + n.encode() + rb"=[^x\0]", raw)]}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(tuple(SECRET_ENV_VARS))}


def _take(env: dict[str, str]) -> dict:
    import json

    p = subprocess.run([sys.executable, "-c", textwrap.dedent(TAKE)], env={**env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_each_command_gets_a_private_file_that_its_one_reader_deletes(tmp_path):
    files = KeyFiles(KEYS, tmp_path / "run")
    trainer, engine, scorer = files.env_for("trainer"), files.env_for("engine"), files.env_for("dedicated")
    assert sorted(trainer) == sorted(n + "_FILE" for n in KEYS)  # rank 0 talks to engines, scorer, service and launcher
    assert list(engine) == ["MEGARL_ENGINE_KEY_FILE"] and list(scorer) == ["MEGARL_DEDICATED_AUTHKEY_FILE"]
    assert engine["MEGARL_ENGINE_KEY_FILE"] != trainer["MEGARL_ENGINE_KEY_FILE"]  # a file per reader
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    for path in [*trainer.values(), *engine.values(), *scorer.values()]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    seen = _take({**_clean_env(), **trainer, "RANK": "0", "MEGARL_ROLE": "trainer"})
    assert seen == {"got": KEYS, "env": [], "proc": []}
    # read once, then gone; the world key's file is every rank's and goes with the directory
    assert [n for n, p in trainer.items() if os.path.exists(p)] == ["MEGARL_WORLD_KEY_FILE"]
    seen = _take({**_clean_env(), **engine, "MEGARL_ROLE": "engine", "RANK": "1"})  # a server is no follower
    assert seen["got"] == {**dict.fromkeys(KEYS, ""), "MEGARL_ENGINE_KEY": KEYS["MEGARL_ENGINE_KEY"]}
    files.close()  # the scorer's file, never read, goes with the directory
    assert not os.path.exists(scorer["MEGARL_DEDICATED_AUTHKEY_FILE"]) and list((tmp_path / "run").iterdir()) == []


def test_a_trainer_follower_needs_no_key_and_leaves_rank_0_its_file(tmp_path):
    """Every trainer rank inherits the same NAME_FILE from torchrun's agent; a follower reading it first would
    take rank 0's key away. The follower drops the carriers (and a plain key's value from /proc) unread, but the
    world key's, which every rank takes and nobody deletes."""
    with KeyFiles(KEYS, tmp_path) as files:
        env = {**_clean_env(), **files.env_for("trainer"), "MEGARL_ROLE": "trainer"}
        for follower in ({"RANK": "1"}, {"OMPI_COMM_WORLD_RANK": "3"}):  # torchrun's rank, mpirun's before bootstrap
            seen = _take({**env, **follower, "MEGARL_AGENT_SERVICE_KEY": "plain-follower-key-1"})
            want = {**dict.fromkeys(KEYS, ""), "MEGARL_WORLD_KEY": KEYS["MEGARL_WORLD_KEY"]}
            assert seen == {"got": want, "env": [], "proc": []}, follower
            assert all(os.path.exists(env[n + "_FILE"]) for n in KEYS)
        assert _take({**env, "RANK": "0"})["got"] == KEYS  # rank 0 still finds every file


def test_a_missing_key_file_is_one_clear_error_on_its_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_ENGINE_KEY_FILE", str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=r"MEGARL_ENGINE_KEY_FILE=.*does not exist.*read once and deleted"):
        take_secret("MEGARL_ENGINE_KEY")


def test_launch_holds_the_keys_in_memory_not_in_its_environment(monkeypatch, tmp_path):
    """An exported key is taken out of the launching process's environment; a generated one never goes in."""
    from test_placement import CFG_30B, plan_for

    plan = plan_for(CFG_30B, nodes=4)  # engines and a scorer with commands of their own
    for name in SECRET_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGARL_AGENT_SERVICE_KEY", KEYS["MEGARL_AGENT_SERVICE_KEY"])
    keys = ensure_run_keys(plan, "slurm")
    assert keys["MEGARL_AGENT_SERVICE_KEY"] == KEYS["MEGARL_AGENT_SERVICE_KEY"]
    assert len(keys["MEGARL_ENGINE_KEY"]) == 48
    assert not any(k.startswith(tuple(SECRET_ENV_VARS)) for k in os.environ)
    with KeyFiles(keys, tmp_path) as files:
        env = child_env("engine", files)  # what the runner starts an engine's command with
    assert [k for k in env if k.startswith(tuple(SECRET_ENV_VARS))] == ["MEGARL_ENGINE_KEY_FILE"]
    assert not any(v in env.values() for v in keys.values())


def test_the_runner_hands_each_command_its_file_and_leaves_none(tmp_path):
    reader = ("from megarl.isolation.secret_env import take_all_secrets, take_secret; take_all_secrets(); "
              "import sys; sys.exit(0 if take_secret('MEGARL_ENGINE_KEY') == 'engine-key-31d7c0' else 9)")
    ok = RoleCommand("trainer", "trainer", "", (sys.executable, "-c", reader), False)
    assert run_commands([ok], poll_s=0.05, key_files=KeyFiles(KEYS, tmp_path)) == 0
    assert list(tmp_path.iterdir()) == []
    early = RoleCommand("trainer", "trainer", "", (sys.executable, "-c", "raise SystemExit(3)"), False)
    assert run_commands([early], poll_s=0.05, key_files=KeyFiles(KEYS, tmp_path)) == 3  # failed before reading
    assert list(tmp_path.iterdir()) == []
