"""The code sandbox fails closed (megarl/rewards/code.py): isolated, or no run, or an explicit opt-out.

What the sandboxed code itself sees is checked (its network interfaces, the
processes in its /proc), with a process beside it holding a key to find.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megarl.builder import load_run_config
from megarl.rewards import code
from megarl.rewards.code import SandboxUnavailable, prepare_sandbox, run_python, run_sandboxed


def test_isolated_code_has_no_network_and_sees_no_other_process():
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "MEGARL_ENGINE_KEY": "held-engine-key-31"})
    try:
        out = run_python(
            "import os, socket\n"
            "print(sorted(n for _, n in socket.if_nameindex()))\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "def environ(p):\n"
            "    try:\n"
            "        return open('/proc/%s/environ' % p, 'rb').read()\n"
            "    except PermissionError:  # the namespace's process 1 is not dumpable\n"
            "        return b''\n"
            "seen = [p for p in pids if b'held-engine-key-31' in environ(p)]\n"
            f"print(len(pids) < 6, seen, os.path.exists('/proc/{holder.pid}/environ'))\n",
            time_limit_s=20)
    finally:
        holder.kill()
        holder.wait()
    assert out.splitlines() == ["['lo']", "True [] False"], out


def test_no_isolation_means_no_run_unless_opted_out(monkeypatch, caplog):
    monkeypatch.setattr(code, "isolation_prefix", lambda *a, **k: ())
    monkeypatch.delenv(code.ALLOW_UNISOLATED_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match=r"set reward\.sandbox_allow_unisolated=true"):
        run_sandboxed("x = 1", ["assert x == 1"])
    cfg = load_run_config(None, ["reward.fn=code"])
    with pytest.raises(SandboxUnavailable, match="cannot isolate code here"):
        prepare_sandbox(cfg)  # the run refuses before it starts (preflight)
    prepare_sandbox(load_run_config(None, []))  # a run without sandboxed code does not care
    cfg = load_run_config(None, ["reward.fn=code", "reward.sandbox_allow_unisolated=true"])
    code._warn_unisolated.cache_clear()
    with caplog.at_level("WARNING"):
        prepare_sandbox(cfg)  # the opt-out reaches the workers through the environment they inherit
        result = run_sandboxed("x = 1", ["assert x == 1", "assert x == 2"])
    assert os.environ[code.ALLOW_UNISOLATED_ENV] == "1"
    assert (result.n_passed, result.n_tests) == (1, 2)
    assert "runs WITH network access" in caplog.text and "reward.sandbox_allow_unisolated=true" in caplog.text
