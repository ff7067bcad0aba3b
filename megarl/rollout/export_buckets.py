"""Where a broadcast publish packs the trainer's export: host shared memory, or the trainer's GPU.

On CPU, and on CUDA with gloo (engines the trainer spawned, which share its
GPU), every bucket is packed in host shared memory: the sender process
(megarl/rollout/broadcast_sender.py) reads it without a copy, and so does the
disk copy's writer (megarl/rollout/disk_copy.py).

On CUDA with NCCL (engines on GPUs of their own) the export stays on the
trainer's GPU (``export_hf_weights(to_host=False)``) and is packed into device
buckets there; the sender receives them as CUDA IPC handles and broadcasts
from the trainer's device: the weights never pass through host memory on
their way to the engines. The disk copy does need host bytes: each device
bucket is copied once into pinned host memory (asynchronous device-to-host
copies, one synchronisation at the end), which the writer reads.

Device buckets hold the model once more on the trainer's GPU during the
publish, so they take at most ``device_budget`` bytes
(:func:`device_budget`: a share of what the trainer's GPU has free); the
buckets past it are packed in host shared memory as on CPU, and the sender
copies each to the GPU as it sends it.
"""
from __future__ import annotations

import torch

from megarl.rollout.weight_sync import group_tensors, pack, payload_bytes

#: the share of the trainer GPU's free memory (its allocator's cached blocks included) device buckets may take;
#: the rest stays for what runs during the stall (a recovery strategy's forward, the next step's start)
DEVICE_SHARE = 0.5


def device_budget(device: torch.device, share: float = DEVICE_SHARE) -> int:
    """Bytes of device buckets the trainer's GPU can hold now (:data:`DEVICE_SHARE` of its free memory)."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(share * (free + cached))


def pack_export(named_tensors, bucket_bytes: int, device: torch.device | None = None,
                budget: int = 0) -> tuple[list, list]:
    """``(send buckets, host buckets)`` of an export, both ``(meta rows, meta bytes, payload)`` in the same order.

    ``device`` None: every bucket in host shared memory, the same list twice. Otherwise the buckets go
    to ``device`` while they fit ``budget`` bytes, the others to host shared memory; the host list
    holds those and a pinned copy of each device bucket (pinned where CUDA is, so the copies run
    asynchronously; plain host memory on a CPU-only test of the same flow).
    """
    send, on_device, used = [], [], 0
    for group in group_tensors(named_tensors, bucket_bytes):
        size = payload_bytes(group)
        here = device is not None and used + size <= budget
        send.append(pack(group, device, share=False) if here else pack(group, torch.device("cpu"), share=True))
        on_device.append(here)
        used += size if here else 0
    if device is None:
        return send, send
    pin = torch.cuda.is_available()
    host = []
    for (rows, meta, payload), here in zip(send, on_device):
        if here:
            mirror = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=pin)
            mirror.copy_(payload, non_blocking=pin)
            payload = mirror
        host.append((rows, meta, payload))
    if pin and device.type == "cuda":
        torch.cuda.synchronize(device)  # the pinned copies are complete before the writer reads them
    return send, host
