"""The dedicated scorer's listener cannot be squatted, and its reads end when the trainer's host vanishes
(recovery/_dedicated_listener.py, recovery/_dedicated_link.py).

Each squatter is a raw socket that does what an attacker or a stuck peer
does (connects and says nothing, sends a pickle instead of the key's answer);
the checks look at what reaches the scorer's side and when.
"""
from __future__ import annotations

import pickle
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.rollout.client import free_port
from recovery import _dedicated_link as link
from recovery import _dedicated_listener as listening
from recovery._dedicated_scorer import DedicatedConfig, listen_address

REPO = Path(__file__).resolve().parents[2]
KEY = b"the-run-key"


def _wait(cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.fixture()
def scorer_port():
    port = free_port()
    listener = listening.listen(port, "127.0.0.1")
    yield port, listener
    listener.close()


def test_an_idle_connection_does_not_delay_the_run_client(scorer_port):
    port, listener = scorer_port
    warnings: list[str] = []
    got = listening.accept_in_background(listener, KEY, warnings.append, handshake_timeout_s=6.0)
    squatters = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # connect, then say nothing
    time.sleep(0.3)
    good = link.TcpLink(f"127.0.0.1:{port}", KEY, connect_timeout_s=30, retry_s=0.1)
    try:
        good.put(("state", None))
        took = _wait(lambda: not got.empty(), 10.0)
        assert took < 4.0, took  # not after the squatters' 6 s handshake deadline
        recv = listening.reader(got.get())
        assert recv() == ("state", None) and good.alive()
        # the squatters are dropped at their deadline, unread
        for s in squatters:
            s.settimeout(10)
            challenge = s.recv(4096)
            assert challenge.startswith(b"\x00\x00\x00") and b"#CHALLENGE#" in challenge
            assert s.recv(4096) == b""
        assert sum("did not prove the key within 6 s" in w for w in warnings) == 3, warnings
    finally:
        good.close(stop=False)
        for s in squatters:
            s.close()


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def test_a_connection_without_the_key_gets_nothing_and_writes_nothing(scorer_port):
    port, listener = scorer_port
    warnings: list[str] = []
    got = listening.accept_in_background(listener, KEY, warnings.append)
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    s.recv(4096)  # the challenge: all a client without the key gets
    s.sendall(_frame(pickle.dumps(("version", (9, "/attacker/weights")))))  # a message instead of the answer
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    s.close()
    assert b"#FAILURE#" in reply and b"version" not in reply
    _wait(lambda: warnings, 5.0)
    assert "wrong key" in warnings[0] and got.empty()
    # the run's client still gets in, and what it reads first is its own message, not the attacker's
    good = link.TcpLink(f"127.0.0.1:{port}", KEY, connect_timeout_s=30, retry_s=0.1)
    try:
        good.put(("state", None))
        assert listening.reader(got.get(timeout=10))() == ("state", None)
    finally:
        good.close(stop=False)


def test_the_trainer_gives_up_on_a_port_that_never_answers():
    """A squatter holding the scorer's port and never answering: the trainer's link fails by its connect
    deadline (plus a second of slack; the bound leaves room for a loaded machine), where it used to stay alive."""
    squat = socket.socket()
    squat.bind(("127.0.0.1", 0))
    squat.listen(8)
    port = squat.getsockname()[1]
    t0 = time.monotonic()
    client = link.TcpLink(f"127.0.0.1:{port}", KEY, connect_timeout_s=2.0, retry_s=0.1)
    try:
        took = _wait(lambda: not client.alive(), 10.0)
        assert took < 5.0, took
        assert "dedicated scorer at" in str(client.failure()) and time.monotonic() - t0 >= 2.0
    finally:
        client.close(stop=False)
        squat.close()


def test_the_scorer_reads_end_when_the_trainer_vanishes_and_heartbeats_keep_it(scorer_port, monkeypatch):
    port, listener = scorer_port
    got = listening.accept_in_background(listener, KEY, lambda _: None)
    # a trainer that proves the key and then goes silent, as one whose host lost power
    silent = listening.client_handshake(("127.0.0.1", port), KEY, 5.0)
    try:
        recv = listening.reader(got.get(timeout=10), peer_timeout_s=1.0)
        t0 = time.monotonic()
        assert recv() == ("closed", None)
        assert 0.9 <= time.monotonic() - t0 < 5.0
    finally:
        silent.close()
    # an idle trainer that is still there: its heartbeats keep the scorer's reads going past the deadline
    monkeypatch.setattr(link, "HEARTBEAT_S", 0.2)
    got = listening.accept_in_background(listener, KEY, lambda _: None)
    idle = link.TcpLink(f"127.0.0.1:{port}", KEY, connect_timeout_s=30, retry_s=0.1)
    try:
        recv = listening.reader(got.get(timeout=10), peer_timeout_s=1.0)
        time.sleep(2.5)
        idle.put(("state", None))
        assert recv() == ("state", None)  # heartbeats are not messages of the protocol
    finally:
        idle.close(stop=False)


def test_the_scorer_binds_the_address_the_trainer_reaches():
    assert listen_address(DedicatedConfig(), "127.0.0.1") == "127.0.0.1"
    assert listen_address(DedicatedConfig(), "localhost") == "127.0.0.1"
    assert listen_address(DedicatedConfig(listen_host="0.0.0.0"), "127.0.0.1") == "0.0.0.0"  # only when asked


def test_the_dry_run_launch_shows_no_key(monkeypatch):
    monkeypatch.delenv("MEGARL_DEDICATED_AUTHKEY", raising=False)
    p = subprocess.run([sys.executable, "-m", "megarl.cli", "launch", "--dry-run", "--launcher", "slurm", "--config",
                        "configs/qwen3_30b_a3b_h100.yaml", "--recovery", "dedicated", "--nodes", "5",
                        "--gpus-per-node", "8", "placement.gpu_memory_gb=141"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "MEGARL_ROLE=dedicated" in out, out[-2000:]
    assert "AUTHKEY=" not in out and "ENGINE_KEY=" not in out
    assert not re.search(r"\b[0-9a-f]{32,}\b", out)  # no key-like hex string at all
