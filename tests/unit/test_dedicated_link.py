"""The dedicated strategy's TCP link to a scorer role on its own node (recovery/_dedicated_link.py).

The link itself is tested in-process against a real Listener; the strategy is
tested against a real role process (``python -m megarl.train`` with
``MEGARL_ROLE=dedicated``) that builds HFScorerForTests through
``scorer_factory`` to stay fast (tests/e2e/test_dedicated_role.py runs the
default Megatron scorer inside the real training loop).
"""
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from recovery_scorer import HFScorerForTests, LoopState, drive_history, tiny_checkpoint

from megarl.errors import ConfigError, ScorerError
from megarl.rollout.client import free_port
from recovery import _dedicated_link as link
from recovery import _dedicated_listener as listening
from recovery import verifier
from recovery.dedicated import Dedicated, DedicatedConfig, serve_role

ROOT = Path(__file__).resolve().parents[2]


def _wait(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_link_connects_late_keeps_order_and_refuses_a_wrong_key():
    port = free_port()
    addr = f"127.0.0.1:{port}"
    # the trainer side starts first: it retries until the scorer listens; what it sends meanwhile waits
    good = link.TcpLink(addr, b"right-key", connect_timeout_s=30, retry_s=0.1)
    good.put(("version", (0, "/shared/run/dedicated/v0")))
    good.put(("score", [{"traj_id": "a"}]))
    time.sleep(0.5)
    assert good.alive() and good.get(None) is None
    listener = listening.listen(port, "127.0.0.1")
    warnings: list[str] = []
    try:
        conn = listening.accept_in_background(listener, b"right-key", warnings.append).get(timeout=20)
        recv = listening.reader(conn)
        assert recv() == ("version", (0, "/shared/run/dedicated/v0"))
        assert recv() == ("score", [{"traj_id": "a"}])
        conn.send(("ready", None))
        conn.send(("scored", [("a", 0, 2, [-0.5, -1.5])]))
        assert good.get(10) == ("ready", None) and good.get(10) == ("scored", [("a", 0, 2, [-0.5, -1.5])])

        # a client with another key: refused before any message, a clear error on its side; the
        # listener logs it and goes on waiting for the right client
        pending = listening.accept_in_background(listener, b"right-key", warnings.append)
        bad = link.TcpLink(addr, b"wrong-key", connect_timeout_s=30, retry_s=0.1)
        _wait(lambda: not bad.alive())
        err = bad.failure()
        assert isinstance(err, ConfigError)
        assert f"the dedicated scorer at {addr} refused the connection: MEGARL_DEDICATED_AUTHKEY differs" in str(err)
        bad.close(stop=True)
        _wait(lambda: warnings)
        assert "wrong key" in warnings[0] and pending.empty()
        other = link.TcpLink(addr, b"right-key", connect_timeout_s=30, retry_s=0.1)
        pending.get(timeout=20).close()
        _wait(lambda: not other.alive())  # the scorer hung up on it
        assert "closed the connection" in str(other.failure())
        other.close(stop=False)

        # close: "stop" after everything queued, then the connection ends
        good.put(("state", None))
        good.close(stop=True)
        assert [recv(), recv(), recv()] == [("state", None), ("stop", None), ("closed", None)]
        conn.close()
    finally:
        listener.close()


def test_missing_key_bad_address_and_nobody_listening():
    with pytest.raises(ConfigError, match="MEGARL_DEDICATED_AUTHKEY is not set.*export the same value"):
        link.authkey_from_env({})
    assert link.authkey_from_env({"MEGARL_DEDICATED_AUTHKEY": "k"}) == b"k"
    with pytest.raises(ConfigError, match="MEGARL_DEDICATED_ADDR='node05' is not host:port"):
        link.TcpLink("node05", b"k", connect_timeout_s=1)
    lonely = link.TcpLink(f"127.0.0.1:{free_port()}", b"k", connect_timeout_s=0.5, retry_s=0.1)
    _wait(lambda: not lonely.alive())
    assert isinstance(lonely.failure(), ScorerError)
    assert "did not accept a connection within 0.5 s (recovery.dedicated.start_timeout_s)" in str(lonely.failure())
    lonely.close(stop=True)
    # the role refuses to start without a port, or for a run that would never connect to it
    run_cfg = SimpleNamespace(recovery=SimpleNamespace(name="dedicated", options={}),
                              model=SimpleNamespace(checkpoint="/nonexistent", dtype="float32"))
    with pytest.raises(ConfigError, match="needs MEGARL_SERVER_PORT"):
        serve_role(run_cfg, 0, b"k")
    with pytest.raises(ConfigError, match="model.checkpoint='/nonexistent' to hold an HF checkpoint"):
        serve_role(run_cfg, 1, b"k")
    run_cfg.recovery.name = "snapshot"
    with pytest.raises(ConfigError, match="MEGARL_ROLE=dedicated with recovery.name=snapshot"):
        serve_role(run_cfg, 1, b"k")


# -- the strategy against a real role process --------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _start_role(ckpt, port: int, key: str, factory: str) -> subprocess.Popen:
    env = {**os.environ, "MEGARL_ROLE": "dedicated", "MEGARL_SERVER_PORT": str(port), "MEGARL_SERVER_HOST": "127.0.0.1",
           "MEGARL_DEDICATED_AUTHKEY": key, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "unit"), os.environ.get("PYTHONPATH", "")])}
    env.pop("MEGARL_DEDICATED_ADDR", None)
    return subprocess.Popen([sys.executable, "-m", "megarl.train", "--config", "configs/tiny_cpu.yaml",
                             f"model.checkpoint={ckpt}", "recovery.name=dedicated",
                             f"recovery.dedicated.scorer_factory={factory}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def _role_reached_over_tcp(ckpt, factory: str, monkeypatch) -> tuple[subprocess.Popen, HFScorerForTests]:
    """A scorer role process on a free port, and the env that makes the strategy connect to it."""
    port, key = free_port(), "unit-test-key"
    role = _start_role(ckpt, port, key, factory)
    monkeypatch.setenv("MEGARL_DEDICATED_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setenv("MEGARL_DEDICATED_AUTHKEY", key)
    return role, HFScorerForTests(ckpt, version=7)


def test_strategy_over_tcp_is_exact_and_the_role_exits_on_stop(ckpt, tmp_path, monkeypatch):
    role, trainer = _role_reached_over_tcp(ckpt, "recovery_scorer:make_hf_scorer", monkeypatch)
    loop = LoopState()
    strat = Dedicated(DedicatedConfig(start_timeout_s=120, wait_timeout_s=120),
                      loop.context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))
    try:
        batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True)
        assert isinstance(strat._link, link.TcpLink)  # not a spawned child
        anchor = strat.anchor(batch, trajs)
        # the role (serving, so past its start) took its key: /proc/<pid>/environ shows it to no other process
        assert b"unit-test-key" not in Path(f"/proc/{role.pid}/environ").read_bytes()
        report = verifier.compare(anchor.logp_anchor, verifier.true_logp_old(batch, params, trainer), batch)
        assert anchor.exact and report["n_tokens"] == 21 and report["max_abs_err"] <= 1e-6, report
        assert not any(math.isnan(x) for t in trajs for x in t.logp_old)
        assert strat.state_dict()["version"] == 8
    finally:
        strat.close()
        rc, out = _stop(role)
    assert rc == 0, out[-3000:]
    assert not (tmp_path / "dedicated").exists()


def test_role_failure_reaches_the_trainer(ckpt, tmp_path, monkeypatch):
    role, trainer = _role_reached_over_tcp(ckpt, "no_such_module:make", monkeypatch)
    strat = Dedicated(DedicatedConfig(start_timeout_s=120, wait_timeout_s=120),
                      LoopState().context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))
    try:
        strat.on_weights_published(7)
        with pytest.raises(RuntimeError, match="(?s)dedicated scoring process failed.*building the scorer failed"
                                               ".*No module named 'no_such_module'"):
            strat.state_dict()
    finally:
        strat.close()
        rc, out = _stop(role)
    assert rc != 0 and "no_such_module" in out
