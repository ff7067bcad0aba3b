"""Two trainer ranks form their world, with megatron's groups, and wait while the test probes the stores
(launched by test_world_store.py under torchrun). Rank 0 writes READY (JSON: the world store's address when
megarl serves one) and the ranks leave once DONE exists."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main(out: str) -> int:
    import torch.distributed as dist

    from megarl.trainer import world_store
    from megarl.trainer.parallel import init_parallel

    torch.set_num_threads(1)
    info = init_parallel(tp=2)
    x = torch.ones(1) * (info.rank + 1)
    dist.all_reduce(x)
    assert x.item() == 3.0
    if info.rank == 0:
        served = [s for s in world_store._alive if isinstance(s, world_store.RendezvousServer)]
        address = [served[0].address, served[0].port] if served else None
        (Path(out) / "READY").write_text(json.dumps({"world_store": address}))
    deadline = time.monotonic() + 120
    while not (Path(out) / "DONE").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
