"""A real Slurm for the e2e tests: munged, slurmctld and slurmd with a slurm.conf of their own.

Single-node: slurmd on this machine. On hosts of tests/cluster_hosts.py: one slurmd per host (in its network
namespace, with its hostname, which is how slurmd finds its NodeName), slurmctld on this machine at the bridge's
address (``SlurmctldHost`` must be this machine's own name), per-node spool, pid and log files.

Debian's slurm-wlm and munge (scripts/install_slurm.sh installs them). The
daemons run as root with their state, spool, pid and log files in a temp
directory; ``SLURM_CONF`` points every client (sbatch, scontrol, scancel) at
that slurm.conf. No cgroup.conf: slurmd 22.05 refuses ``CgroupPlugin=disabled``
but starts without the file (proctrack/linuxproc, task/none).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


def missing_tools() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]


def _conf(root: Path, host: str, cpus: int, nodes=None, ctl_addr: str = "") -> str:
    """``nodes``: (name, address) of each host of a namespace cluster; None: this machine alone."""
    per_node = "/%n" if nodes else ""
    node_lines = ([f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=8000 State=UNKNOWN" for n, a in nodes] if nodes
                  else [f"NodeName={host} CPUs={cpus} RealMemory=20000 State=UNKNOWN"])
    names = ",".join(n for n, _ in nodes) if nodes else host
    return "\n".join([
        "ClusterName=megarltest", f"SlurmctldHost={host}" + (f"({ctl_addr})" if ctl_addr else ""), "SlurmUser=root",
        "AuthType=auth/munge", f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool{per_node}",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd{'.%n' if nodes else ''}.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd{'.%n' if nodes else ''}.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "JobRequeue=1", "KillWait=30", "MpiDefault=none",
        "SchedulerType=sched/backfill", "SlurmctldPort=16817", "SlurmdPort=16818",
        *node_lines, f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP", ""])


class LocalSlurm:
    """Start with :meth:`start`, stop with :meth:`stop`; :attr:`env` is what the clients need."""

    def __init__(self, root: Path, hosts=None) -> None:
        """``hosts``: a tests/cluster_hosts.py Cluster whose hosts are the nodes; None: this machine."""
        self.root, self.hosts = root, hosts
        self._daemons: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged_started = False

    def _munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
        for d in (key.parent, Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged already runs
        subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True)
        self._munged_started = True

    def start(self, timeout_s: float = 60.0) -> None:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        nodes = [(h.name, h.addr) for h in self.hosts.hosts] if self.hosts else None
        cpus = os.cpu_count() or 2
        self.conf.write_text(_conf(self.root, self.host, cpus, nodes, self.hosts.bridge_addr if nodes else ""))
        self._munge()
        if self.hosts:  # in the foreground, so the cluster's teardown ends them whatever happens
            self._daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env,
                                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
            self._daemons += [self.hosts.popen(h, ["slurmd", "-D", "-f", str(self.conf)], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                              for h in self.hosts.hosts]
        else:
            subprocess.run(["slurmctld"], env=self.env, check=True)
            subprocess.run(["slurmd"], env=self.env, check=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._all_idle():
                return
            time.sleep(1)
        raise RuntimeError(f"the local Slurm node did not become idle within {timeout_s} s:\n{self.logs()}")

    def node_idle(self) -> bool:
        """The node runs nothing and cleans up nothing: sinfo says idle (not completing) and no slurmstepd is left."""
        import psutil

        return self._all_idle() and not any(p.info["name"] == "slurmstepd"
                                                 for p in psutil.process_iter(["name"]))

    def _all_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True).stdout
        states = out.split()
        return bool(states) and all(s == "idle" for s in states)

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.root.glob("*.log")))

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, check=True).stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``-o``: one line of key=value)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True,
                             text=True).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def stop(self) -> None:
        for p in self._daemons:
            if p.poll() is None:
                p.terminate()
        for p in self._daemons:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for name in ("slurmd", "slurmctld") if not self._daemons else ():
            pid_file = self.root / f"{name}.pid"
            if pid_file.exists():
                pid = int(pid_file.read_text().split()[0])
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    continue
                for _ in range(100):
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.1)
        if self._munged_started:
            pid_file = Path("/run/munge/munged.pid")
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().split()[0]), 15)
                except (ProcessLookupError, ValueError):
                    pass
