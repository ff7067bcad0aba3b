"""Two trainer ranks (torchrun, gloo): rank 0's publish fails while it packs the export; the follower is released.

The exporter gathers each tensor's two halves over the world group, one
all_gather per tensor, as megarl's TP/EP export does (megarl/models/bridge.py),
and the follower consumes it as megarl/loop/spmd.py's follower loop does.
Rank 0 runs the real BroadcastPublisher.prepare in the device flow (the CPU
standing in for the trainer's GPU, as in tests/unit/test_export_buckets.py),
whose packing fails at the third bucket as a device bucket that does not fit
would. Rank 0 then stays alive (a trainer that goes on), so only rank 0's own
draining can release the follower before the group's timeout. Each rank
writes rank{r}.json into --out.
"""
import argparse
import asyncio
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GROUP_TIMEOUT_S = 20
N_TENSORS, NUMEL = 8, 1000


class HalvesExporter:
    """Each rank holds half of every tensor; the export all_gathers the halves, one collective per tensor."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.n_yielded = 0

    def exported_hf_config(self) -> dict:
        return {"dtype": "float32"}

    def export_hf_weights(self, *, to_host: bool = True):
        for i in range(N_TENSORS):
            half = torch.arange(NUMEL // 2, dtype=torch.float32) + (i * NUMEL + self.rank * NUMEL // 2)
            parts = [torch.empty_like(half) for _ in range(2)]
            dist.all_gather(parts, half)
            self.n_yielded += 1
            yield f"t{i}", torch.cat(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    trainer = HalvesExporter(rank)
    if rank == 0:
        import megarl.rollout.export_buckets as export_buckets
        from megarl.rollout.publish import BroadcastPublisher

        real_pack, calls = export_buckets.pack, []

        def pack_that_runs_out_of_memory(*a, **kw):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("device bucket does not fit (injected on the third bucket)")
            return real_pack(*a, **kw)

        export_buckets.pack = pack_that_runs_out_of_memory
        pub = BroadcastPublisher(trainer, None, out / "weights")
        pub.bucket_bytes = 4 << 10  # one tensor a bucket
        pub._sender_device = lambda: torch.device("cpu")
        pub.device_budget = 1 << 40
        t0 = time.monotonic()
        try:
            asyncio.run(pub.prepare(1))
            result = {"error": None}
        except Exception as e:  # noqa: BLE001 - the failure the test expects
            result = {"error": f"{type(e).__name__}: {e}"}
        result.update(failed_s=time.monotonic() - t0, n_yielded=trainer.n_yielded, disk_copy=(out / "weights").exists())
        follower = out / "rank1.json"
        deadline = time.monotonic() + 2 * GROUP_TIMEOUT_S  # alive, as a trainer that goes on would be
        while not follower.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        pub.close()
    else:
        t0 = time.monotonic()
        try:
            for _ in trainer.export_hf_weights(to_host=False):
                pass
            result = {"error": None}
        except Exception as e:  # noqa: BLE001 - a follower stuck till the group's timeout
            result = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        result.update(released_s=time.monotonic() - t0, n_yielded=trainer.n_yielded)
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")
    os._exit(0)  # no destroy_process_group: a rank left in a failed collective must not hang the exit


if __name__ == "__main__":
    main()
