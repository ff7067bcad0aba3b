"""Rendezvous check run by every trainer rank instead of training (`megarl launch --bootstrap-check`).

Bootstraps from MPI when started by mpirun, initializes torch.distributed
(gloo on CPU, NCCL on GPU), all-reduces rank+1 and gathers every rank's
MASTER_ADDR/MASTER_PORT. Each rank prints one ``RENDEZVOUS_CHECK {json}``
line and exits 1 when the sum is wrong or the ranks disagree on the rendezvous.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from megarl.trainer.mpi_bootstrap import bootstrap_env_from_mpi


def main() -> int:
    bootstrapped = bootstrap_env_from_mpi() is not None
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)], device="cuda" if cuda else "cpu")
    dist.all_reduce(t)
    mine = [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]
    seen: list = [None] * world
    dist.all_gather_object(seen, mine)
    expected = world * (world + 1) / 2
    ok = float(t.item()) == expected and all(s == mine for s in seen)
    report = {"rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "host": socket.gethostname(), "master_addr": mine[0], "master_port": int(mine[1]),
              "all_reduce": float(t.item()), "expected": expected, "backend": dist.get_backend(),
              "mpi_bootstrap": bootstrapped, "agree": all(s == mine for s in seen), "ok": ok}
    # one write per line: ranks share stdout, and a pipe write below PIPE_BUF is not interleaved
    sys.stdout.write("RENDEZVOUS_CHECK " + json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
