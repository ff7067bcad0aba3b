"""Ranks started by ``mpirun`` -> the torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

torch has no MPI backend in its wheels, so MPI is used only to start the
ranks and agree on a rendezvous: rank 0 picks MASTER_ADDR/MASTER_PORT and
broadcasts them with mpi4py, every rank learns its local rank from the
gathered host names, and MPI is finalized again. Tensors then go over gloo
(CPU) or NCCL (GPU) through ``init_process_group(init_method="env://")``.

Call :func:`bootstrap_env_from_mpi` before ``torch.distributed`` is
initialized; it does nothing outside an MPI job or when RANK and WORLD_SIZE
are already set (torchrun, or a second call).
"""
from __future__ import annotations

import os
import socket
from typing import MutableMapping

from megarl.errors import ConfigError
from megarl.rollout.client import free_port

#: world size variables of Open MPI and of Hydra-based MPIs (MPICH, Intel MPI)
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def _first(env: MutableMapping[str, str], names: tuple[str, ...]) -> str | None:
    for n in names:
        if env.get(n):
            return env[n]
    return None


def under_mpi(env: MutableMapping[str, str] | None = None) -> bool:
    """True in a process started by mpirun/mpiexec."""
    return _first(os.environ if env is None else env, _SIZE_VARS) is not None


def _from_env_only(env: MutableMapping[str, str]) -> dict[str, str]:
    """Without mpi4py: the launcher's own variables, and MASTER_ADDR/PORT exported by the user (mpirun -x)."""
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        raise ConfigError("mpirun bootstrap needs mpi4py (pip install mpi4py) to agree on MASTER_ADDR/MASTER_PORT, "
                          "or both exported to every rank (mpirun -x MASTER_ADDR=host -x MASTER_PORT=port)")
    local_rank = _first(env, _LOCAL_RANK_VARS)
    local_size = _first(env, _LOCAL_SIZE_VARS)
    if local_rank is None or local_size is None:
        raise ConfigError("mpirun bootstrap without mpi4py needs the MPI's local-rank variables "
                          f"({' / '.join(_LOCAL_RANK_VARS)}); install mpi4py")
    return {"RANK": _first(env, _RANK_VARS) or "0", "WORLD_SIZE": _first(env, _SIZE_VARS) or "1",
            "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_size,
            "MASTER_ADDR": env["MASTER_ADDR"], "MASTER_PORT": env["MASTER_PORT"]}


def _from_mpi4py(env: MutableMapping[str, str], master_port: int | None) -> dict[str, str]:
    from mpi4py import MPI  # optional package (without it: the launcher's variables, _from_env_only)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    hosts = comm.allgather(host)
    nodes = list(dict.fromkeys(hosts))  # in rank order
    if rank == 0:
        # one host: loopback needs no name resolution; several: the host name every node resolves
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(nodes) == 1 else host)
        port = int(env.get("MASTER_PORT") or master_port or free_port("" if len(nodes) > 1 else addr))
        chosen = (addr, port)
    else:
        chosen = None
    addr, port = comm.bcast(chosen, root=0)
    comm.Barrier()
    if not MPI.Is_finalized():
        MPI.Finalize()
    return {"RANK": str(rank), "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(hosts[:rank].count(host)), "LOCAL_WORLD_SIZE": str(hosts.count(host)),
            "GROUP_RANK": str(nodes.index(host)), "NODE_RANK": str(nodes.index(host)),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def bootstrap_env_from_mpi(env: MutableMapping[str, str] | None = None, *,
                           master_port: int | None = None) -> dict[str, str] | None:
    """Set the torch.distributed variables from MPI; returns what it set, or None when there was nothing to do.

    ``master_port``: use this port instead of a free one picked on rank 0
    (MASTER_PORT in the environment wins over both).
    """
    env = os.environ if env is None else env
    if ("RANK" in env and "WORLD_SIZE" in env) or not under_mpi(env):
        return None
    try:
        import mpi4py  # noqa: F401  (optional package)
    except ImportError:
        values = _from_env_only(env)
    else:
        values = _from_mpi4py(env, master_port)
    values["MEGARL_MPI_BOOTSTRAP"] = "1"
    env.update(values)
    return values
