"""The multi-host harness itself (tests/cluster_hosts.py): hosts with their own names and addresses reach each
other over the bridge, the hosts-file trap host resolves its own name to 127.0.1.1, and nothing is left behind,
neither after a test that raised nor from an earlier run that was killed."""
import subprocess
import sys

import pytest
from cluster_hosts import Cluster, _ip, cluster, remove_leftovers, require_namespaces

pytestmark = pytest.mark.e2e

PROBE = """
import socket, sys
role, name = sys.argv[1], sys.argv[2]
if role == "serve":
    s = socket.create_server((socket.gethostbyname(name), 7801))
    print("ready", flush=True)
    c, peer = s.accept()
    c.sendall(f"{socket.gethostname()} {peer[0]}".encode())
    c.close()
else:
    print(socket.gethostname(), socket.gethostbyname(name),
          socket.create_connection((name, 7801), timeout=10).recv(100).decode())
"""


def _ours() -> set[str]:
    out = _ip("netns", "list").stdout + _ip("-o", "link").stdout
    return {w.split("@")[0] for w in out.replace(":", " ").split() if w.startswith("mrlc")}


def test_hosts_reach_each_other_by_name_and_the_trap_resolves_to_loopback(tmp_path):
    with cluster(3, tmp_path, trap="node3") as c:
        server = c.popen("node2", [sys.executable, "-c", PROBE, "serve", "node2"], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        r = c.run("node1", [sys.executable, "-c", PROBE, "connect", "node2"], timeout=30)
        assert r.returncode == 0, r.stderr
        me, node2_addr, answer = r.stdout.split(maxsplit=2)
        assert (me, node2_addr) == ("node1", c.host("node2").addr)
        assert answer.split() == ["node2", c.host("node1").addr]  # the peer is node1's bridge address
        trap = c.run("node3", [sys.executable, "-c", "import socket; print(socket.gethostbyname('node3'))"])
        seen = c.run("node1", [sys.executable, "-c", "import socket; print(socket.gethostbyname('node3'))"])
        assert (trap.stdout.strip(), seen.stdout.strip()) == ("127.0.1.1", c.host("node3").addr)
    assert not _ours() & {c.bridge, *(h.ns for h in c.hosts), *(f"{c.tag}v{i}" for i in (1, 2, 3))}


def test_teardown_after_a_failure_and_leftovers_of_a_killed_run(tmp_path):
    require_namespaces()
    with pytest.raises(RuntimeError, match="the test failed"):
        with cluster(1, tmp_path) as c:
            c.popen("node1", ["sleep", "600"])
            raise RuntimeError("the test failed")
    assert not _ours() & {c.bridge, c.hosts[0].ns}
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"mrlc{dead.pid}b", f"mrlc{dead.pid}h1"]  # what a run killed before its teardown left
    _ip("link", "add", names[0], "type", "bridge")
    _ip("netns", "add", names[1])
    try:
        assert sorted(remove_leftovers()) == sorted(names)
        assert not _ours() & set(names)
    finally:
        for args in (("link", "del", names[0]), ("netns", "del", names[1])):
            _ip(*args, check=False)
    live = Cluster(1, tmp_path / "live")  # a run still going is never touched
    try:
        assert live.hosts[0].ns not in remove_leftovers()
        assert live.hosts[0].ns in _ours()
    finally:
        live.close()


def test_without_root_the_tests_skip_naming_why_and_fail_in_ci(monkeypatch):
    import cluster_hosts

    monkeypatch.setattr(cluster_hosts.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="network namespaces, which needs root"):
        require_namespaces()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: multi-host tests make network namespaces"):
        require_namespaces()
