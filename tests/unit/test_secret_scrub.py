"""The run's secrets stay with their owners (megarl/isolation/secret_env.py, megarl/isolation/process_isolation.py).

Children that run user code (agent commands, tool and reward workers) start
without any key of the run, a process that took a key no longer shows it in
/proc/<pid>/environ, and an agent command cannot read the run's processes or
another episode's command. The checks look at what the child itself sees
(its environment, /proc), never at megarl's own bookkeeping.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megarl.config.agent import AgentConfig
from megarl.errors import ConfigError
from megarl.isolation import process_isolation
from megarl.isolation.secret_env import SECRET_ENV_VARS, pass_by_pipe, scrubbed_env
from megarl.workers.pool import WorkerPool
from megarl.workflows import agent_http
from megarl.workflows.agent_http import CommandLimits, run_command

REPO = Path(__file__).resolve().parents[2]
#: the run's keys as a launching shell exports them (values found by substring in what a child sees)
KEYS = {"MEGARL_ENGINE_KEY": "engine-key-4f1c9a", "MEGARL_DEDICATED_AUTHKEY": "scorer-key-77d2e0",
        "MEGARL_AGENT_SERVICE_KEY": "service-key-0b93aa11", "MEGARL_STOP_KEY": "stop-key-5e21c7",
        "MEGARL_WORLD_KEY": "world-key-c3a9f2"}


def test_the_secret_list_names_each_key_once():
    assert sorted(SECRET_ENV_VARS) == sorted(KEYS)  # the five secrets of a run, by hand
    env = {**KEYS, "MEGARL_ENGINE_KEY_FD": "7", "MEGARL_DEDICATED_AUTHKEY_FILE": "/x", "PATH": "/bin", "HOME": "/h"}
    assert scrubbed_env(env, OPENAI_API_KEY="ep") == {"PATH": "/bin", "HOME": "/h", "OPENAI_API_KEY": "ep"}


def _python(code: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60, **kw)


def test_a_taken_key_leaves_proc_environ_and_the_environment():
    """A process started with the key in its environment (as srun starts a role) takes it: /proc/<pid>/environ,
    which other processes of the user read, shows it no more, also when the environment was rebuilt before (the
    C environ array then no longer points to the exec-time block); without taking it, it does (the control)."""
    check = """
        import os, sys
        from megarl.isolation.secret_env import take_secret
        if sys.argv[1] == "rebuilt":  # code that rebuilds the environment (mock.patch.dict does) before the take
            saved = dict(os.environ)
            os.environ.clear()
            os.environ.update(saved)
        if sys.argv[1] in ("take", "rebuilt"):
            assert take_secret("MEGARL_ENGINE_KEY") == "engine-key-4f1c9a"
            assert take_secret("MEGARL_ENGINE_KEY") == "engine-key-4f1c9a"  # held in memory
        print(b"engine-key-4f1c9a" in open("/proc/self/environ", "rb").read(), "MEGARL_ENGINE_KEY" in os.environ)
    """
    env = {**os.environ, "MEGARL_ENGINE_KEY": KEYS["MEGARL_ENGINE_KEY"]}
    for mode, seen in (("take", "False False"), ("rebuilt", "False False"), ("keep", "True True")):
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(check), mode], env={**env, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.split() == seen.split(), (mode, p.stdout, p.stderr)


def test_a_key_comes_by_pipe_or_by_a_private_file(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    fd = pass_by_pipe("MEGARL_ENGINE_KEY", "piped-key-91", env)
    try:
        p = _python("""
            import os
            from megarl.isolation.secret_env import take_secret
            print(take_secret("MEGARL_ENGINE_KEY"), [k for k in os.environ if k.startswith("MEGARL_ENGINE_KEY")],
                  b"piped-key-91" in open("/proc/self/environ", "rb").read())
        """, env, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert p.stdout.split() == ["piped-key-91", "[]", "False"], p.stderr
    secret = tmp_path / "key"
    secret.write_text("filed-key-55\n")
    secret.chmod(0o644)
    code = 'from megarl.isolation.secret_env import take_secret; print(take_secret("MEGARL_DEDICATED_AUTHKEY"))'
    p = _python(code, {**env, "MEGARL_DEDICATED_AUTHKEY_FILE": str(secret)})
    assert "must be mode 0600" in p.stderr and "chmod 600" in p.stderr and secret.exists()
    secret.chmod(0o600)
    p = _python(code, {**env, "MEGARL_DEDICATED_AUTHKEY_FILE": str(secret)})
    assert p.stdout.strip() == "filed-key-55" and not secret.exists(), p.stderr  # read once, then gone


def what_a_worker_sees() -> str:
    """A tool run in a worker process: the run's keys it finds in its environment and its /proc entry."""
    raw = open("/proc/self/environ", "rb").read().decode(errors="replace")
    # a key's variable in any of its forms (NAME, NAME_FD, NAME_FILE); other MEGARL_ settings (the sandbox's
    # opt-out, which a worker needs) are not secrets and may be there
    return json.dumps(sorted({k for k in os.environ if any(k.startswith(name) for name in KEYS)} |
                             {name for name, value in KEYS.items() if value in raw or name in raw}))


def test_tool_and_reward_workers_start_without_the_run_keys(monkeypatch):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    pool = WorkerPool("tool", {"look": f"{__name__}:what_a_worker_sees"}, n_workers=1, timeout_s=30, memory_mb=None,
                      label="test")
    try:
        kind, seen = asyncio.run(pool.call(("look", {})))
    finally:
        pool.close()
    assert (kind, json.loads(seen)) == ("ok", [])


_SCAN = r"""
import json, os, sys, time
mine = os.environ.get("OPENAI_API_KEY", "")
time.sleep(float(sys.argv[1]))  # the other episode runs meanwhile
found = set()
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            raw = open("/proc/%s/environ" % pid, "rb").read().decode(errors="replace")
        except OSError:
            continue
        found |= {w for w in json.loads(sys.argv[2]) if w in raw and w != mine}
print(json.dumps(sorted(found)))
"""


def _holder(secrets: list[str]) -> subprocess.Popen:
    """A long-lived process with every key in its exec-time environment (a launcher or an engine that kept them)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, **KEYS, "OTHER": " ".join(secrets)})


async def _two_episodes(words: list[str], limits: CommandLimits) -> list[list[str]]:
    argv = [sys.executable, "-c", _SCAN]
    outs = await asyncio.gather(*(run_command(argv + ["2.5", json.dumps(words)], {}, {"OPENAI_API_KEY": f"episode-{i}"},
                                              30.0, limits) for i in range(2)))
    return [json.loads(o) for o in outs]


def test_an_agent_command_finds_no_key_in_any_proc_environ(monkeypatch):
    """Two concurrent episodes, each scanning /proc/*/environ for the run's keys and the other's episode key, while
    a process holding every key runs beside them: isolated, they find nothing; unisolated (the control), all."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    words = [*KEYS.values(), "episode-0", "episode-1"]
    holder = _holder(words)
    try:
        assert asyncio.run(_two_episodes(words, CommandLimits())) == [[], []]
        monkeypatch.setattr(agent_http, "isolation_prefix", lambda *a, **k: ())
        control = asyncio.run(_two_episodes(words, CommandLimits(allow_unisolated=True)))
    finally:
        holder.kill()
        holder.wait()
    assert set(KEYS.values()) <= set(control[0]) and "episode-1" in control[0] and "episode-0" in control[1]


def test_an_agent_command_gets_its_own_key_and_no_other(monkeypatch):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    code = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if 'KEY' in k}))"
    out = asyncio.run(run_command([sys.executable, "-c", code], {}, {"OPENAI_API_KEY": "episode-7"}, 30.0))
    assert json.loads(out) == {"OPENAI_API_KEY": "episode-7"}


def test_agent_commands_fail_closed_without_isolation(monkeypatch, caplog):
    cfg = AgentConfig(command=f"{sys.executable} -c pass")
    assert CommandLimits.from_config(cfg).prefix(("127.0.0.1", 1))  # this machine isolates
    monkeypatch.setattr(agent_http, "isolation_prefix", lambda *a, **k: ())
    with pytest.raises(ConfigError, match="agent.command cannot be isolated here.*agent.command_allow_unisolated=true"):
        CommandLimits.from_config(cfg)
    cfg.command_allow_unisolated = True
    agent_http._warn_unisolated.cache_clear()
    with caplog.at_level("WARNING"):
        out = asyncio.run(run_command([sys.executable, "-c", "print('ran')"], {}, {}, 30.0,
                                      CommandLimits.from_config(cfg)))
    assert out.strip() == "ran" and "WITHOUT a PID namespace" in caplog.text


def test_the_namespace_keeps_exit_statuses():
    """Under the isolation prefix a command's exit code and its death by a signal read as they would without it."""
    prefix = process_isolation.isolation_prefix()
    assert prefix
    for code, want in (("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9)):
        rc = subprocess.run([*prefix, sys.executable, "-c", code], timeout=60).returncode
        assert process_isolation.exit_status(rc, prefix) == want, (code, rc)
