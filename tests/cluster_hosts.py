"""Several hosts on this machine: network + UTS namespaces on a Linux bridge, for the multi-node tests.

Each host is a network namespace with one veth link on a bridge of the test's own, an address on a /24 of
its own, its own hostname (a UTS namespace per command) and its own ``/etc/hosts`` (a mount namespace per
command that binds ``/etc/netns/<ns>/hosts`` over it, as ``ip netns exec`` does, but without remounting
``/sys``, which slurmd needs). The filesystem is shared: a directory under /tmp is the cluster's shared disk.

Names carry this process's pid (``mrlc<pid>``: the bridge ``mrlc<pid>b``, the namespaces ``mrlc<pid>h<i>``,
the host ends of the links ``mrlc<pid>v<i>``), so parallel runs do not collide and the leftovers of a run that
was killed before its teardown are found by name and removed (:func:`remove_leftovers`) once its pid is gone.
Traffic goes only to 127.0.0.0/8 and to the addresses made here.

``trap``: one host whose ``/etc/hosts`` maps its own name to 127.0.1.1, as Ubuntu images do, where every
other host maps it to its cluster address.

Needs root and iproute2 / util-linux (``ip``, ``nsenter``, ``unshare``); :func:`require_namespaces` skips a
test without them, naming why, and fails it instead where ``CI=true`` (CI must run these tests).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PREFIX = "mrlc"
NAME_RE = re.compile(rf"^{PREFIX}(\d+)(?:b|h\d+|v\d+)$")
NETNS_DIR = Path("/etc/netns")
TOOLS = ("ip", "nsenter", "unshare", "mount")


def why_not() -> str:
    """'' where namespaces can be made here, else the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "multi-host tests make network namespaces, which needs root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"multi-host tests need {', '.join(missing)} (iproute2, util-linux)"
    return ""


def require_namespaces() -> None:
    """Skip the test, naming why, where namespaces cannot be made; fail it instead in CI."""
    reason = why_not()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(ns: str) -> None:
    """Every process still in a namespace of ours (started by the tests in it) is killed by its pid."""
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in out:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_leftovers() -> list[str]:
    """Remove namespaces, links and hosts files of earlier runs whose process is gone; returns their names."""
    removed = []
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    links = [m.group(1).split("@")[0] for m in re.finditer(r"^\d+: ([^:]+):", _ip("-o", "link").stdout, re.M)]
    netns_files = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.is_dir() else []
    for name in dict.fromkeys([*namespaces, *links, *netns_files]):
        m = NAME_RE.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        if name in namespaces:
            _kill_netns_pids(name)
            _ip("netns", "del", name, check=False)
        if name in links:
            _ip("link", "del", name, check=False)
        shutil.rmtree(NETNS_DIR / name, ignore_errors=True)
        removed.append(name)
    return removed


def _free_subnet(start: int) -> str:
    """A 10.213.X /24 no interface of this machine has an address in (X from ``start``)."""
    used = _ip("-o", "-4", "addr").stdout
    for k in range(250):
        third = (start + k) % 250
        prefix = f"10.213.{third}."
        if f" {prefix}" not in used:
            return prefix
    raise RuntimeError("no free 10.213.X.0/24 subnet on this machine")


@dataclass
class Host:
    name: str
    """Its hostname (what `hostname` says inside, and the name every host's /etc/hosts maps)."""
    ns: str
    """Its network namespace (``ip netns``)."""
    addr: str
    """Its address on the bridge."""


class Cluster:
    """``n`` hosts named ``names`` (default node1..nodeN) on a bridge; :meth:`close` tears everything down."""

    def __init__(self, n: int, run_dir: Path, names: list[str] | None = None, trap: str | None = None) -> None:
        remove_leftovers()
        pid = os.getpid()
        self.tag = f"{PREFIX}{pid}"
        self.bridge = f"{self.tag}b"
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        names = names or [f"node{i}" for i in range(1, n + 1)]
        self.procs: list[subprocess.Popen] = []
        self.hosts: list[Host] = []
        self.trap = trap
        try:
            prefix = _free_subnet(pid % 250)
            self.bridge_addr = f"{prefix}254"
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self.add_host(name, f"{prefix}{i}")
            self.write_hosts_files()
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str, addr: str) -> Host:
        i = len(self.hosts) + 1
        host = Host(name, f"{self.tag}h{i}", addr)
        veth = f"{self.tag}v{i}"
        self.hosts.append(host)
        _ip("netns", "add", host.ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        for args in (("addr", "add", f"{addr}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up")):
            _ip("-n", host.ns, *args)
        return host

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def write_hosts_files(self) -> None:
        """Each host's /etc/hosts: every host's name at its address (the trap host's own at 127.0.1.1)."""
        for h in self.hosts:
            lines = ["127.0.0.1 localhost"]
            for other in self.hosts:
                own_trap = other is h and h.name == self.trap
                lines.append(f"{'127.0.1.1' if own_trap else other.addr} {other.name}")
            d = NETNS_DIR / h.ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def argv(self, host: str | Host, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, with its hostname and its /etc/hosts."""
        h = host if isinstance(host, Host) else self.host(host)
        inner = (f"mount --bind {shlex.quote(str(NETNS_DIR / h.ns / 'hosts'))} /etc/hosts && "
                 f"hostname {shlex.quote(h.name)} && exec \"$@\"")
        return ["nsenter", f"--net=/var/run/netns/{h.ns}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", inner, "sh", *argv]

    def popen(self, host: str | Host, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own; :meth:`close` ends it if it still runs."""
        p = subprocess.Popen(self.argv(host, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, host: str | Host, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        p = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._end(p)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def link_down(self, host: str) -> None:
        """Cut ``host`` off the bridge (a lost node)."""
        _ip("link", "set", f"{self.tag}v{self.hosts.index(self.host(host)) + 1}", "down")

    @staticmethod
    def _end(p: subprocess.Popen, grace_s: float = 5.0) -> None:
        if p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # the session this test started for it
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    def close(self) -> None:
        """End every process started on the hosts, then remove the namespaces, links and hosts files."""
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                self._end(p)
        for h in self.hosts:
            _kill_netns_pids(h.ns)
        deadline = time.monotonic() + 10
        for h in self.hosts:
            while _ip("netns", "pids", h.ns, check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", h.ns, check=False)
            shutil.rmtree(NETNS_DIR / h.ns, ignore_errors=True)
        for i in range(1, len(self.hosts) + 1):  # the pair usually goes with its namespace, not everywhere (gVisor)
            if f"{self.tag}v{i}:" in _ip("-o", "link").stdout.replace("@", ":"):
                _ip("link", "del", f"{self.tag}v{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def cluster(n: int, run_dir: Path, **kw):
    """:class:`Cluster` for a test: skipped (failed in CI) where namespaces cannot be made, torn down after."""
    require_namespaces()
    c = Cluster(n, run_dir, **kw)
    try:
        yield c
    finally:
        c.close()
