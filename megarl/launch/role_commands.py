"""Render a :class:`~megarl.launch.placement.Plan` as per-role commands (torchrun, slurm, mpirun).

Every role runs the one entry point, ``python -m megarl.train --config X
[key=value ...]``; what differs is the launcher around it and the role's
environment (``MEGARL_*`` variables, read back by :mod:`megarl.launch.roles`).
The variables go through ``env K=V`` in front of the program, which works the
same under srun, mpirun and a plain shell (srun's ``--export`` would split
values that contain commas).

A dedicated scorer with its own command and the trainer authenticate their
TCP connection with ``MEGARL_DEDICATED_AUTHKEY``, a random key per run that no command line holds
(megarl/launch/engine_key_env.py);
engines with commands of their own take requests only with the run's
``MEGARL_ENGINE_KEY`` (megarl/launch/engine_key_env.py), and serve on their
node's address in the plan (``MEGARL_SERVER_HOST``).

Stops (megarl/stop_protocol.py): torchrun gets a ``--shutdown-timeout`` longer
than ``logging.stop_grace_s`` and handles SIGUSR1 too, so a stop it passes on
never ends in its SIGKILL mid-checkpoint. Slurm steps ask for GPUs with
``--gpus-per-node``, the form launch/slurm.sbatch asks with (a step's
``--gres=gpu:N`` beside the ``SLURM_GPUS_PER_NODE`` the batch environment
passes on is refused by recent Slurm), and each step writes its own log.
mpirun passes the user's environment on to remote ranks (:func:`forwarded_env`),
never a run secret: a command that needs one gets the path of its own key
file (``-x NAME_FILE``, megarl/isolation/key_files.py).
"""
from __future__ import annotations

import os
import shlex
import socket
from dataclasses import dataclass, field

from megarl.errors import ConfigError
from megarl.isolation.secret_env import DEDICATED_AUTHKEY_ENV, FILE_SUFFIX
from megarl.launch.engine_key_env import has_own_engines
from megarl.launch.slurm_scripts import engine_tasks_script, node_rank_script
from megarl.rollout.engine_key import ENGINE_KEY_ENV
from megarl.stop_protocol import STOP_MARKER_ENV

LAUNCHERS = ("torchrun", "slurm", "mpirun")
CHECK_MODULE = "megarl.launch.rendezvous_check"
AUTHKEY_ENV = DEDICATED_AUTHKEY_ENV
#: run secrets: neither they nor the variables that say where to read one (NAME_FD, NAME_FILE) go into a
#: forwarded list (each travels its own way, or not at all)
SECRET_ENV = ("MEGARL_ENGINE_KEY", "MEGARL_DEDICATED_AUTHKEY", "MEGARL_AGENT_SERVICE_KEY")
#: prefixes of the variables mpirun passes on to remote ranks (besides PATH, LD_LIBRARY_PATH, placement.forward_env)
FORWARD_PREFIXES = ("NCCL_", "HF_", "CUDA_", "MEGARL_", "TORCH_", "PYTHON", "OMP_", "VLLM_")
#: what torchrun waits for its workers after passing a stop on, beyond logging.stop_grace_s
SHUTDOWN_MARGIN_S = 30
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True)
class LaunchSettings:
    """What the commands take from the run config beyond the plan."""

    stop_grace_s: float = 90.0
    """logging.stop_grace_s: torchrun's shutdown timeout is this plus SHUTDOWN_MARGIN_S."""
    forward_env: tuple[str, ...] = field(default=())
    """placement.forward_env: more variable names mpirun passes on."""
    stop_marker: str = ""
    """The stop marker trainer rank 0 writes (MEGARL_STOP_MARKER; megarl/launch/runner.py); "" = none."""
    log_dir: str = ""
    """Where each Slurm step writes its log (the run directory when the config names it); "" = the working dir."""

    def trainer_env(self) -> dict[str, str]:
        return {STOP_MARKER_ENV: self.stop_marker} if self.stop_marker else {}


@dataclass(frozen=True)
class RoleCommand:
    """One process (or one srun/mpirun step) of the plan."""

    name: str
    """trainer, trainer@<host>, engine<i> or dedicated."""
    role: str
    """trainer, engine or dedicated."""
    host: str
    """Where to run the command: the launch host for slurm/mpirun (they reach the nodes), the node itself
    for torchrun."""
    argv: tuple[str, ...]
    server: bool
    """Engines and the scorer serve until the trainer is done; the launcher stops them then."""

    def shell(self) -> str:
        return shlex.join(self.argv)


def _env_prefix(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def _entry(plan, python: str, *, check: bool, module_flag: bool = False) -> list[str]:
    """The program after the launcher; ``module_flag``: torchrun wants ``-m MODULE`` without the interpreter."""
    if check:
        mod_args = [CHECK_MODULE]
    else:
        mod_args = ["megarl.train", *(["--config", plan.config_path] if plan.config_path else []), *plan.overrides]
    return (["-m"] if module_flag else [python, "-m"]) + mod_args


def _gpus(ids) -> str:
    return ",".join(str(i) for i in ids)


def _has_own_dedicated(plan) -> bool:
    return plan.dedicated is not None and not plan.dedicated.spawned


def role_env(plan, role: str, server=None, *, set_visible_devices: bool) -> dict[str, str]:
    """The MEGARL_* variables of one role (and CUDA_VISIBLE_DEVICES where the launcher does not bind GPUs)."""
    env: dict[str, str] = {}
    gpu_ids = plan.trainer.gpu_ids if role == "trainer" else server.gpu_ids
    if set_visible_devices and plan.device == "gpu" and gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = _gpus(gpu_ids)
    env["MEGARL_ROLE"] = role
    # the controller builds the group itself with the engines it spawns; these are for servers with own commands
    broadcast = plan.weight_sync == "broadcast" and any(not s.spawned for s in plan.servers)
    if broadcast:
        env["MEGARL_WEIGHT_SYNC_ADDR"] = f"{plan.master_addr}:{plan.weight_sync_port}"
        env["MEGARL_WEIGHT_SYNC_WORLD"] = str(plan.weight_sync_world)
    if role == "trainer":
        remote = [e.addr for e in plan.engines if not e.spawned]
        if remote:
            env["MEGARL_ENGINE_ADDRS"] = ",".join(remote)
        if _has_own_dedicated(plan):
            env["MEGARL_DEDICATED_ADDR"] = plan.dedicated.addr
    else:
        if role == "engine":
            env["MEGARL_ENGINE_INDEX"] = str(server.index)
        env["MEGARL_SERVER_HOST"] = server.listen_host  # the address it serves on: the one the trainer reaches
        env["MEGARL_CONTROLLER_HOST"] = plan.trainer.hosts[0]  # whether that must be reachable from another node
        env["MEGARL_SERVER_PORT"] = str(server.port)
        env["MEGARL_SERVER_TP"] = str(server.tp)
        if broadcast and role == "engine":
            env["MEGARL_WEIGHT_SYNC_RANK"] = str(plan.weight_sync_rank(server))
    return env


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _torchrun_stop(settings: LaunchSettings) -> list[str]:
    """torchrun passes every stop signal on to its workers and waits for their checkpoint (module doc)."""
    return [f"--shutdown-timeout={int(settings.stop_grace_s) + SHUTDOWN_MARGIN_S}",
            f"--signals-to-handle={TORCHRUN_SIGNALS}"]


# -- torchrun: one command per node, run on that node -----------------------------------------------
def _torchrun(plan, python: str, check: bool, settings: LaunchSettings) -> list[RoleCommand]:
    t = plan.trainer
    out = []
    for i, host in enumerate(t.hosts):
        env = {**role_env(plan, "trainer", set_visible_devices=True), **settings.trainer_env()}
        if len(t.hosts) == 1 and not plan.master_port_explicit:
            rdzv = ["--standalone", "--nnodes=1"]
        else:
            rdzv = [f"--nnodes={len(t.hosts)}", f"--node-rank={i}", f"--master-addr={plan.master_addr}",
                    f"--master-port={plan.master_port}"]
        argv = [*_env_prefix(env), python, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={t.ranks_per_node}",
                *_torchrun_stop(settings), *_entry(plan, python, check=check, module_flag=True)]
        name = "trainer" if len(t.hosts) == 1 else f"trainer.node{i}"
        out.append(RoleCommand(name, "trainer", host, tuple(argv), False))
    if check:
        return out
    for s in plan.servers:
        if s.spawned:
            continue
        env = role_env(plan, s.role, s, set_visible_devices=True)
        prog = _entry(plan, python, check=False)  # vLLM starts its own TP workers; the scorer is one process
        out.append(RoleCommand(s.name, s.role, s.host, tuple(_env_prefix(env) + prog), True))
    return out


# -- slurm: one srun step per role, all started from the batch host ----------------------------------
def _slurm_cpus(plan, gpus: int) -> list[str]:
    """A GPU step's share of the node's cores (srun --exact would give it one core per task otherwise)."""
    cpus, G = plan.allocation.cpus_per_node, plan.allocation.gpus_per_node
    if plan.device != "gpu" or not cpus or not G:
        return []
    return [f"--cpus-per-task={max(1, cpus * gpus // G)}"]


def _slurm_mem(plan, gpus: int) -> list[str]:
    """A GPU step's share of the node's host memory. Without it a step asks for all of the job's memory on
    its node, and a second step on that node (two engines, or an engine beside trainer ranks) waits for the
    first to end wherever memory is a consumable resource."""
    mem, G = plan.allocation.mem_per_node_mb, plan.allocation.gpus_per_node
    if plan.device != "gpu" or not mem or not G:
        return []
    return [f"--mem={max(1, mem * gpus // G)}M"]


def _slurm_step(plan, name: str, gpus: int, settings: LaunchSettings, task_gpus: int | None = None) -> list[str]:
    """A step's GPUs in the batch's own form (--gpus-per-node, module doc), its cores per task (``task_gpus``
    GPUs' share; default all of ``gpus``) and its own log file (one per task where a step has several)."""
    log = os.path.join(settings.log_dir, f"slurm-megarl-%j.{name}{'.%t' if task_gpus else ''}.out")
    return [*([f"--gpus-per-node={gpus}"] if plan.device == "gpu" else []), *_slurm_cpus(plan, task_gpus or gpus),
            *_slurm_mem(plan, gpus), "--exact", f"--job-name=megarl-{name}", f"--output={log}"]


def _slurm(plan, python: str, check: bool, settings: LaunchSettings) -> list[RoleCommand]:
    t = plan.trainer
    env = {**role_env(plan, "trainer", set_visible_devices=False), **settings.trainer_env()}
    srun = ["srun", f"--nodes={len(t.hosts)}", f"--ntasks={len(t.hosts)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(t.hosts)}", *_slurm_step(plan, "trainer", t.ranks_per_node, settings),
            "--kill-on-bad-exit=1"]
    # static node ranks: rank 0 on the plan's first trainer host, where MASTER_ADDR and the engines point
    torchrun = [python, "-m", "torch.distributed.run", f"--nnodes={len(t.hosts)}"]
    rest = [f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}",
            f"--nproc-per-node={t.ranks_per_node}", *_torchrun_stop(settings),
            *_entry(plan, python, check=check, module_flag=True)]
    out = [RoleCommand("trainer", "trainer", "", tuple(srun + _env_prefix(env)
                                                       + ["bash", "-c", node_rank_script(t.hosts, torchrun, rest)]),
                       False)]
    if check:
        return out
    steps: dict[str, list] = {}  # engines of one node share a step (megarl/launch/slurm_scripts.py)
    for s in plan.servers:
        if not s.spawned:
            steps.setdefault(f"{s.role}@{s.host}", []).append(s)
    for group in steps.values():
        out.append(_slurm_server(plan, group[0], python, settings) if len(group) == 1
                   else _slurm_shared_engines(plan, group, python, settings))
    return out


def _slurm_server(plan, s, python: str, settings: LaunchSettings) -> RoleCommand:
    """The step of one engine or of the dedicated scorer: Slurm gives it its GPUs."""
    srun = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={s.host}", *_slurm_step(plan, s.name, s.tp, settings)]
    env = role_env(plan, s.role, s, set_visible_devices=False)
    return RoleCommand(s.name, s.role, "", tuple(srun + _env_prefix(env) + _entry(plan, python, check=False)), True)


def _slurm_shared_engines(plan, engines, python: str, settings: LaunchSettings) -> RoleCommand:
    """One step for the engines of one node, a task each with its own slice of the step's GPUs."""
    name, n, gpus = f"engines.{engines[0].host}", len(engines), sum(s.tp for s in engines)
    srun = ["srun", "--nodes=1", f"--ntasks={n}", f"--ntasks-per-node={n}", f"--nodelist={engines[0].host}",
            *_slurm_step(plan, name, gpus, settings, task_gpus=engines[0].tp), "--kill-on-bad-exit=1"]
    tasks = [(_env_prefix(role_env(plan, "engine", s, set_visible_devices=False)) + _entry(plan, python, check=False),
              s.tp) for s in engines]
    script = engine_tasks_script(tasks, gpus=plan.device == "gpu")
    return RoleCommand(name, "engine", "", tuple(srun + ["bash", "-c", script]), True)


# -- mpirun: MPI starts the ranks; megarl.trainer.mpi_bootstrap turns them into a torch world ----------
def forwarded_env(names: tuple[str, ...] = (), env=None) -> list[str]:
    """The variables mpirun passes on to remote ranks: PATH, LD_LIBRARY_PATH, those of this environment that
    start with :data:`FORWARD_PREFIXES`, and ``names`` (placement.forward_env) where set; never a run secret."""
    env = os.environ if env is None else env
    secret = [n for n in names if n.startswith(SECRET_ENV)]
    if secret:
        raise ConfigError(f"placement.forward_env names {', '.join(secret)}: a run secret never travels by "
                          f"environment forwarding; drop it from placement.forward_env")
    wanted = ["PATH", "LD_LIBRARY_PATH", *sorted(k for k in env if k.startswith(FORWARD_PREFIXES)), *names]
    return [k for k in dict.fromkeys(wanted) if k in env and not k.startswith(SECRET_ENV)]


def _mpirun_base(plan, n: int, hosts_slots: list[tuple[str, int]], settings: LaunchSettings, *,
                 authkey: bool = False, engine_key: bool = False) -> list[str]:
    """``authkey``: the command needs MEGARL_DEDICATED_AUTHKEY, ``engine_key``: MEGARL_ENGINE_KEY (which `megarl
    launch` makes when the launching environment has none); each is passed on as its key file's path."""
    argv = ["mpirun", "-n", str(n)]
    if _is_root():
        argv.append("--allow-run-as-root")
    local = plan.allocation.source == "local" and all(h == socket.gethostname() for h, _ in hosts_slots)
    if not local:
        argv += ["--host", ",".join(f"{h}:{k}" for h, k in hosts_slots), "--map-by", f"ppr:{hosts_slots[0][1]}:node"]
        argv += [a for name in forwarded_env(settings.forward_env) for a in ("-x", name)]
        if authkey:  # the path of the command's own key file (megarl/isolation/key_files.py), never the key
            argv += ["-x", AUTHKEY_ENV + FILE_SUFFIX]
        if engine_key:
            argv += ["-x", ENGINE_KEY_ENV + FILE_SUFFIX]
    if plan.device == "cpu":
        argv.append("--oversubscribe")  # ranks are processes, not cores
    argv += ["--bind-to", "none"]
    return argv


def _mpirun(plan, python: str, check: bool, settings: LaunchSettings) -> list[RoleCommand]:
    t = plan.trainer
    env = {**role_env(plan, "trainer", set_visible_devices=True), **settings.trainer_env()}
    if plan.master_port_explicit or len(t.hosts) > 1:
        env["MASTER_PORT"] = str(plan.master_port)
    if plan.master_addr != t.hosts[0] or len(t.hosts) > 1:
        env["MASTER_ADDR"] = plan.master_addr
    base = _mpirun_base(plan, t.world_size, [(h, t.ranks_per_node) for h in t.hosts], settings,
                        authkey=_has_own_dedicated(plan), engine_key=has_own_engines(plan))
    entry = tuple(base + _env_prefix(env) + _entry(plan, python, check=check))
    out = [RoleCommand("trainer", "trainer", "", entry, False)]
    if check:
        return out
    for s in plan.servers:
        if s.spawned:
            continue
        # one process each: vLLM starts its own TP workers, the scorer is one rank (the plan refuses tp > 1)
        base = _mpirun_base(plan, 1, [(s.host, 1)], settings, authkey=s.role == "dedicated",
                            engine_key=s.role == "engine")
        env = role_env(plan, s.role, s, set_visible_devices=True)
        entry = tuple(base + _env_prefix(env) + _entry(plan, python, check=False))
        out.append(RoleCommand(s.name, s.role, "", entry, True))
    return out


def render(plan, launcher: str, *, python: str, bootstrap_check: bool = False,
           settings: LaunchSettings | None = None) -> list[RoleCommand]:
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    return {"torchrun": _torchrun, "slurm": _slurm, "mpirun": _mpirun}[launcher](
        plan, python, bootstrap_check, settings or LaunchSettings())
