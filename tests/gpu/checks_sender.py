"""The GPU check of a weight sender killed mid-publish (tests/gpu/gpu_check.py: sender_kill).

The trainer hands megarl/rollout/broadcast_sender.py's SenderProcess device buckets one at a time; the sender's
group here stalls at bucket STALL_AT, past the step deadline, and the sender is killed holding what it held then.
After the trainer lets go of its buckets (megarl.rollout.publish.release_ipc_blocks, empty_cache) its GPU memory must be
back at its baseline: torch keeps a block the trainer shared by CUDA IPC alive for as long as the trainer lives
once its consumer died holding it, which a sender given views of the trainer's buckets would leak. On CUDA the
same kill with the trainer's bucket handed straight to the killed process (the flow the sender had before) is
run as the negative control, and its leak reported. On CPU (GPU_CHECK_ALLOW_CPU=1) the buckets are shared memory
and the node's Shmem must be back where it was.
"""
from __future__ import annotations

import time
from pathlib import Path

from check_helpers import MIB, require, require_cuda

#: the buckets of the publish: KILL_BUCKETS x KILL_BUCKET_MIB
KILL_BUCKETS, KILL_BUCKET_MIB = 8, 64
#: the bucket the stand-in group stalls at, and the sender's step deadline, s
STALL_AT, KILL_DEADLINE_S = 2, 5.0
#: trainer GPU memory (memory_reserved) or node shared memory allowed above the baseline after the kill
KILL_TOLERANCE = 1 * MIB
#: device memory in use allowed above the baseline after the kill (the driver's granularity)
DEVICE_TOLERANCE = 64 * MIB


class StallingGroupStandIn:
    """What the sender makes its group with in this check: it joins nothing, takes buckets, and at bucket
    STALL_AT of a stream of more than one bucket sleeps past any deadline (a lost engine). A stand-in: only what
    the sender holds is under test."""

    def __init__(self, host, port, world_size, *, backend, timeout_s, group_id, secret, serve_rendezvous, shards):
        self.group_id = group_id
        self.sent = 0

    def connect(self) -> None:
        return None

    def send_bucket(self, meta, payload, shard) -> None:
        if self.sent == STALL_AT:
            time.sleep(3600)  # the sender is killed here
        float(payload.view(-1)[:1].float().sum())  # read it, as a broadcast would
        self.sent += 1

    def end_stream(self) -> None:
        self.sent = 0

    def close(self) -> None:
        return None


def group_info() -> dict:
    return {"host": "127.0.0.1", "port": 0, "world_size": 2, "backend": "gloo", "timeout_s": KILL_DEADLINE_S,
            "group_id": "sender-kill", "secret": "s"}


def kill_mid_publish(device) -> None:
    """A publish of KILL_BUCKETS buckets on ``device`` whose sender is killed while it sends bucket STALL_AT."""
    import torch

    from megarl.errors import EngineError
    from megarl.rollout.broadcast_sender import SenderProcess

    proc = SenderProcess(StallingGroupStandIn, device.index if device.type == "cuda" else None)
    proc.send(group_info(), [(bytes(16), torch.zeros(8, device=device), 0)], timeout_s=120).result(180)  # started
    n = KILL_BUCKET_MIB * MIB
    buckets = [(bytes(16), torch.full((n,), i, dtype=torch.uint8, device=device), 0) for i in range(KILL_BUCKETS)]
    if device.type == "cpu":
        buckets = [(m, p.share_memory_(), s) for m, p, s in buckets]
    fut = proc.send(group_info(), buckets, timeout_s=KILL_DEADLINE_S)
    del buckets  # the sender's watcher holds the rest; the publisher lets go of its own list at the same time
    try:
        fut.result(KILL_DEADLINE_S * (KILL_BUCKETS + 2) + 30)
    except EngineError:
        pass
    else:
        raise AssertionError("the stalled publish succeeded: the stand-in group did not stall")
    require(not proc.proc.is_alive(), "the sender outlived its missed deadline")
    proc.kill()


def _hold_forever(conn) -> None:  # the negative control's consumer: takes a CUDA tensor and keeps it
    t = conn.recv()
    conn.send(int(t.numel()))
    time.sleep(3600)


def leak_of_the_old_flow() -> int:
    """Bytes the trainer keeps once a process it handed a device bucket by CUDA IPC is killed holding it."""
    import torch
    import torch.multiprocessing as tmp

    from megarl.rollout.publish import release_ipc_blocks

    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_hold_forever, args=(child,), daemon=True)
    p.start()
    base = torch.cuda.memory_reserved()
    bucket = torch.ones(KILL_BUCKET_MIB * MIB, dtype=torch.uint8, device="cuda")
    parent.send(bucket)
    parent.recv()
    p.kill()
    p.join(10)
    del bucket
    torch.cuda.synchronize()
    release_ipc_blocks()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() - base


def check_sender_kill(workdir: Path) -> str:
    require_cuda()
    import gc

    import torch

    from megarl.rollout.publish import release_ipc_blocks

    if not torch.cuda.is_available():  # GPU_CHECK_ALLOW_CPU=1: the same flow with shared-memory buckets
        from checks_publish import unit_stand_ins

        _, shmem = unit_stand_ins()
        gc.collect()
        base = shmem()
        kill_mid_publish(torch.device("cpu"))
        gc.collect()
        left = shmem() - base
        require(left <= KILL_TOLERANCE, f"{left / MIB:.1f} MiB of shared memory held after the sender was killed")
        return (f"CPU: sender killed sending bucket {STALL_AT} of {KILL_BUCKETS}; shared memory back within "
                f"{left / MIB:.2f} MiB")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=device)  # this process's context first: it is not the publish's
    torch.cuda.synchronize()
    base, free0 = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    kill_mid_publish(device)
    gc.collect()
    torch.cuda.synchronize()
    release_ipc_blocks()
    torch.cuda.empty_cache()
    time.sleep(1.0)  # the driver frees the dead sender's context and staging buffer
    left = torch.cuda.memory_reserved() - base
    device_left = free0 - torch.cuda.mem_get_info()[0]
    leak = leak_of_the_old_flow()
    detail = (f"sender killed sending bucket {STALL_AT} of {KILL_BUCKETS} ({KILL_BUCKET_MIB} MiB each): trainer memory "
              f"{left / MIB:+.1f} MiB from its baseline, device free memory {-device_left / MIB:+.1f} MiB; the "
              f"former flow (a trainer bucket held by a killed process) leaves {leak / MIB:.0f} MiB behind")
    require(left <= KILL_TOLERANCE, f"the trainer's GPU memory did not come back: {detail}")
    require(device_left <= DEVICE_TOLERANCE, f"the device's free memory did not come back: {detail}")
    return detail
