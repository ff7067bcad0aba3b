"""The allocation a plan is placed on: hosts and GPUs per host.

Sources, in the order :func:`detect` tries them:

- simulated: ``--nodes N --gpus-per-node G`` (dry runs anywhere);
- Slurm: ``SLURM_JOB_NODELIST`` (expanded by ``scontrol show hostnames`` when
  it is installed, else by :func:`expand_nodelist`), ``SLURM_NNODES``,
  ``SLURM_GPUS_ON_NODE`` / ``SLURM_GPUS_PER_NODE``, the job's memory per node
  (:func:`_slurm_mem_mb`);
- inside an MPI job: ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_LOCAL_SIZE``;
- inside a torchrun job: ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``;
- this machine alone.

MPI and torchrun do not tell a rank the names of the other hosts; those
allocations name them ``rank-node1``, ``rank-node2``, ... after the first.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from megarl.errors import ConfigError


@dataclass(frozen=True)
class Allocation:
    """Hosts a plan may use, in order, and how many GPUs each has (None = not reported)."""

    hosts: tuple[str, ...]
    gpus_per_node: int | None
    source: str
    """simulated, slurm, mpi, torchrun or local."""
    job_id: str = ""
    notes: tuple[str, ...] = field(default=())
    cpus_per_node: int | None = None
    """CPU cores per node when the source reports them (Slurm: SLURM_CPUS_ON_NODE)."""
    mem_per_node_mb: int | None = None
    """Host memory per node the job holds, MB (Slurm: SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x cores, or
    for a job that holds whole nodes without a memory request, 90% of this node's MemTotal)."""

    @property
    def n_nodes(self) -> int:
        return len(self.hosts)

    def describe(self) -> str:
        gpus = "? GPUs" if self.gpus_per_node is None else f"{self.gpus_per_node} GPUs"
        job = f" job {self.job_id}" if self.job_id else ""
        return f"{self.source}{job}: {self.n_nodes} node(s) x {gpus} ({compress_hosts(self.hosts)})"


# -- Slurm's compressed host lists ---------------------------------------------------------
def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"host list {text!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ConfigError(f"host list {whole!r}: bad range {item!r} (expected N or N-M)")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"host list {whole!r}: range {item!r} runs backwards")
        width = len(lo)  # Slurm keeps the zero padding of the range start: 01-10 -> 01 .. 10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [head + value + rest for value in _expand_range(m.group(1), whole) for rest in _expand_one(tail, whole)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list: 'node[01-03,07],gpu-a' -> node01 node02 node03 node07 gpu-a."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    if not hosts:
        raise ConfigError(f"host list {nodelist!r} names no host")
    return hosts


def short_host(host: str) -> str:
    """A host's short name (``node03`` of ``node03.cluster.local``): how a node is named across the plan."""
    return host.split(".")[0]


def compress_hosts(hosts: tuple[str, ...] | list[str]) -> str:
    """Short human form of a host list (not Slurm's exact algorithm): node01..node04 -> node[01-04]."""
    groups: list[tuple[str, list[str]]] = []
    for h in hosts:
        m = re.fullmatch(r"(.*?)(\d+)", h)
        prefix, num = (m.group(1), m.group(2)) if m else (h, "")
        if groups and groups[-1][0] == prefix and num and groups[-1][1] and \
                len(groups[-1][1][-1]) == len(num) and int(groups[-1][1][-1]) + 1 == int(num):
            groups[-1][1].append(num)
        else:
            groups.append((prefix, [num] if num else []))
    out = []
    for prefix, nums in groups:
        if len(nums) > 1:
            out.append(f"{prefix}[{nums[0]}-{nums[-1]}]")
        else:
            out.append(prefix + (nums[0] if nums else ""))
    return ",".join(out)


def _scontrol_hostnames(nodelist: str) -> list[str] | None:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = out.split()
    return hosts or None


def _slurm_gpus_per_node(env: dict[str, str]) -> int | None:
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    per_node = env.get("SLURM_GPUS_PER_NODE", "")
    if per_node:
        # "8", "h100:8", or "h100:8(x4)"-style forms
        m = re.search(r"(\d+)(?:\(x\d+\))?$", per_node.split(",")[0])
        if m:
            return int(m.group(1))
    if env.get("SLURM_JOB_GPUS"):
        return len([g for g in env["SLURM_JOB_GPUS"].split(",") if g])
    return None


# -- the sources -------------------------------------------------------------------------------
def simulated(nodes: int, gpus_per_node: int, prefix: str = "node") -> Allocation:
    if nodes < 1 or gpus_per_node < 0:
        raise ConfigError(f"simulated allocation needs --nodes >= 1 and --gpus-per-node >= 0, "
                          f"got {nodes} and {gpus_per_node}")
    width = max(2, len(str(nodes)))
    return Allocation(tuple(f"{prefix}{i:0{width}d}" for i in range(1, nodes + 1)), gpus_per_node, "simulated")


def from_slurm(env: dict[str, str] | None = None) -> Allocation | None:
    env = dict(os.environ if env is None else env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = _scontrol_hostnames(nodelist) or expand_nodelist(nodelist)
    notes = []
    n = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if n and n.isdigit() and int(n) != len(hosts):
        notes.append(f"SLURM_NNODES={n} but SLURM_JOB_NODELIST names {len(hosts)} hosts; using the host list")
    cpus = env.get("SLURM_CPUS_ON_NODE", "")
    cpus_per_node = int(cpus) if cpus.isdigit() else None
    return Allocation(tuple(hosts), _slurm_gpus_per_node(env), "slurm", env.get("SLURM_JOB_ID", ""), tuple(notes),
                      cpus_per_node, _slurm_mem_mb(env, cpus_per_node))


def _slurm_mem_mb(env: dict[str, str], cpus_per_node: int | None, meminfo: str = "/proc/meminfo") -> int | None:
    """The job's memory per node in MB: what each srun step gets a share of (role_commands._slurm_mem).

    A job without a memory request that holds whole nodes (``--exclusive``, as launch/slurm.sbatch asks)
    reports none; it owns the node's memory then, read here on the batch host (one of the job's nodes,
    which are alike), less 10% that Slurm keeps for the node itself (RealMemory is below MemTotal).
    """
    if env.get("SLURM_MEM_PER_NODE", "").isdigit():
        return int(env["SLURM_MEM_PER_NODE"])
    if env.get("SLURM_MEM_PER_CPU", "").isdigit() and cpus_per_node:
        return int(env["SLURM_MEM_PER_CPU"]) * cpus_per_node
    try:
        with open(meminfo) as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb * 9 // 10 // 1024


def _from_world(world: int, local: int, first: str, source: str) -> Allocation:
    if local < 1 or world % local:
        raise ConfigError(f"{source}: world size {world} is not a multiple of the ranks per node {local}")
    nodes = world // local
    return Allocation((first, *(f"rank-node{i}" for i in range(1, nodes))), local, source)


def from_mpi(env: dict[str, str] | None = None) -> Allocation | None:
    env = dict(os.environ if env is None else env)
    size = env.get("OMPI_COMM_WORLD_SIZE")
    if not size:
        return None
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)
    return _from_world(int(size), int(local), socket.gethostname(), "mpi")


def from_torchrun(env: dict[str, str] | None = None) -> Allocation | None:
    env = dict(os.environ if env is None else env)
    if "WORLD_SIZE" not in env or "LOCAL_WORLD_SIZE" not in env:
        return None
    return _from_world(int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]),
                       env.get("MASTER_ADDR") or socket.gethostname(), "torchrun")


def local_gpu_count(env: dict[str, str] | None = None) -> int:
    """GPUs of this machine without importing torch: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`."""
    env = dict(os.environ if env is None else env)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def local() -> Allocation:
    return Allocation((socket.gethostname(),), local_gpu_count(), "local")


def detect(nodes: int | None = None, gpus_per_node: int | None = None) -> Allocation:
    """The allocation from the first source that applies (module docstring)."""
    if nodes is not None or gpus_per_node is not None:
        if nodes is None or gpus_per_node is None:
            raise ConfigError("a simulated allocation needs both --nodes and --gpus-per-node")
        return simulated(nodes, gpus_per_node)
    for source in (from_slurm, from_mpi, from_torchrun):
        alloc = source()
        if alloc is not None:
            return alloc
    return local()
