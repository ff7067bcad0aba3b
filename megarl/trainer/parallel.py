"""torch.distributed + megatron parallel_state initialization (gloo on CPU, NCCL on GPU).

Under torchrun the process group comes from the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its ranks meeting in the authenticated
store of megarl/trainer/world_store.py when they hold the run's world key; a
plain ``python`` process gets a world of one. megatron's parallel_state is process-global: :func:`init_parallel`
reuses it when the sizes match and rebuilds it when they differ (tests build
several trainers in one process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.errors import MegarlError, TrainingError
from megarl.isolation.secret_env import remove_shared_files
from megarl.platform.cpu import seed_model_parallel_rng
from megarl.platform.megatron import prepare_megatron
from megarl.trainer.mpi_bootstrap import bootstrap_env_from_mpi
from megarl.trainer.world_store import authenticated_store


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp: int
    pp: int
    ep: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def comm_device() -> torch.device:
    """Where tensors handed to collectives must live: the current GPU under NCCL, the CPU under gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank() -> int:
    """This process's rank in the default process group; 0 when there is none (a plain process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


#: how long a rank waits in one collective of any trainer group (trainer.collective_timeout_s, set by
#: :func:`init_distributed`; torch's gloo default until then)
_collective_timeout = timedelta(minutes=30)
#: what a timed-out collective says, lower-cased: gloo ("... Timed out waiting 30000ms for recv operation to
#: complete"; "Application timeout caused pair closure" from a pair whose peer never answered), NCCL's watchdog
#: ("Watchdog caught collective operation timeout: ... ran for N milliseconds before timing out")
_TIMEOUT_TEXT = ("timed out waiting", "application timeout caused pair closure", "collective operation timeout",
                 "before timing out")


def collective_timeout() -> timedelta:
    """The timeout every group of the trainer world is made with (trainer.collective_timeout_s)."""
    return _collective_timeout


def timed_out_collective(exc: BaseException | None) -> BaseException | None:
    """The exception in ``exc``'s chain (itself, or one it came from) that is a collective that timed out waiting
    for another trainer rank (torch's error, or megarl's that quotes it, e.g. a background checkpoint's); None."""
    seen: set[int] = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (RuntimeError, MegarlError)) and any(t in str(e).lower() for t in _TIMEOUT_TEXT):
            return e
        e = e.__cause__ or e.__context__
    return None


def lost_rank_error(exc: BaseException, timeout_s: float, run_dir) -> TrainingError | None:
    """The error to stop with when ``exc`` is a collective that timed out waiting for another trainer rank
    (:func:`timed_out_collective`): a trainer node lost mid-run or a rank hung; None for any other error."""
    e = timed_out_collective(exc)
    if e is None:
        return None
    text = str(e).strip()
    first = text.splitlines()[0][:300] if text else type(e).__name__
    return TrainingError(
        f"trainer rank {global_rank()} waited trainer.collective_timeout_s={timeout_s:g} s in a collective "
        f"for another trainer rank ({first}): a trainer node was lost (its network down, its host stopped) "
        f"or a rank hung. The newest complete checkpoint under {run_dir}/checkpoints stands; once every node "
        f"is back, run the same launch with logging.resume={run_dir}")


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialize the default process group once (env:// under torchrun, else a world of one); ``timeout_s``
    (trainer.collective_timeout_s) bounds every collective of it and of the groups made after it."""
    global _collective_timeout
    if dist.is_initialized():
        return
    if timeout_s:
        _collective_timeout = timedelta(seconds=float(timeout_s))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = authenticated_store(rank, world)  # only holders of the run's world key (world_store.py)
        if store is None:
            dist.init_process_group(backend=backend, init_method="env://", timeout=_collective_timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                                    timeout=_collective_timeout)
            dist.barrier()  # every rank has read the world key's file by now: the first on each node removes it
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                remove_shared_files()
    else:
        # one process, no torchrun: an in-memory store needs no port
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_ranks(timeout_s: float | None = None) -> tuple[int, int]:
    """(rank, world size) of the trainer ranks; a plain process is rank 0 of 1 (no process group yet).
    ``timeout_s``: trainer.collective_timeout_s (:func:`init_distributed`)."""
    bootstrap_env_from_mpi()  # under mpirun: RANK/WORLD_SIZE/MASTER_* from MPI (no-op otherwise)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    init_distributed(timeout_s)
    return dist.get_rank(), dist.get_world_size()


def init_parallel(*, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0) -> ParallelInfo:
    """Set up torch.distributed and megatron's TP/PP/EP groups; seed megatron's RNG trackers."""
    prepare_megatron()
    init_distributed()
    # megatron: imported only after prepare_megatron() made it safe here (its CPU patches, TE)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size() == tp
                and ps.get_pipeline_model_parallel_world_size() == pp
                and ps.get_expert_model_parallel_world_size() == ep)
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep,
                                     distributed_timeout_minutes=_collective_timeout.total_seconds() / 60)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        seed_model_parallel_rng(seed)
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), tp=tp, pp=pp, ep=ep,
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def shutdown() -> None:
    """Tear down megatron's groups and the default process group (end of a command)."""
    from megatron.core import parallel_state as ps  # megatron: after prepare_megatron()

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
