"""Where a broadcast publish packs the trainer's export: host shared memory, or the trainer's GPU.

On CPU, and on CUDA with gloo (engines the trainer spawned, which share its
GPU), every bucket is packed in host shared memory: the sender process
(megarl/rollout/broadcast_sender.py) reads it without a copy, and so does the
disk copy's writer (megarl/rollout/disk_copy.py).

On CUDA with NCCL (engines on GPUs of their own) the export stays on the
trainer's GPU (``export_hf_weights(to_host=False)``) and is packed into device
buckets there; each is copied on the device into a staging buffer the sender
process owns (never shared with it: megarl/rollout/broadcast_sender.py), which
it broadcasts from the same GPU: the weights never pass through host memory on
their way to the engines. The disk copy does need host bytes: each device
bucket is copied once into pinned host memory (asynchronous device-to-host
copies, one synchronisation at the end), which the writer reads.

Device buckets hold the model once more on the trainer's GPU during the
publish, so they take at most ``device_budget`` bytes
(:func:`device_budget`: a share of what the trainer's GPU has free, less the
sender's staging buffer and one host bucket it copies to the GPU); the
buckets past it are packed in host shared memory as on CPU, and the sender
copies each to the GPU as it sends it.

The export is a collective (every trainer rank gathers each tensor over its
TP/EP/PP groups; the followers replay it, megarl/loop/spmd.py), and rank 0
packs as it streams. If rank 0's consumer fails half-way (a device bucket
that does not fit, a cast), the followers would wait in the next gather for
good: :func:`consume_export` then drains the rest of the export on rank 0,
dropping each tensor at once, so every rank leaves the collective together,
and raises the consumer's error after it.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

import torch

from megarl.rollout.bucket_format import group_tensors, iter_buckets, pack, payload_bytes, unpack
from megarl.rollout.engine_shards import ShardRule, shard_rows

log = logging.getLogger("megarl.rollout.publish")


class CollectiveExport:
    """Rank 0's view of the trainer's export: ``(name, convert(tensor))`` in order, and :meth:`drain` for
    what the consumer did not take (``convert`` failing leaves the export itself where it was)."""

    def __init__(self, exported: Iterable, convert: Callable | None = None) -> None:
        self._raw = iter(exported)
        self._convert = convert

    def __iter__(self):
        for name, t in self._raw:
            yield name, (t if self._convert is None else self._convert(t))

    def drain(self) -> int:
        """Take the rest of the export (each tensor dropped as it comes); how many tensors that was."""
        n = 0
        for _ in self._raw:
            n += 1
        return n


def consume_export(export: CollectiveExport, consumer: Callable):
    """``consumer(iter(export))``; when it raises, the rest of the export is drained first (module doc)."""
    try:
        return consumer(iter(export))
    except Exception as e:
        try:
            n = export.drain()
        except Exception as drain_error:  # noqa: BLE001 - the export itself failed: the original error says more
            log.error("draining the export after %s failed too (%s): other trainer ranks may still wait in its "
                      "gathers", type(e).__name__, drain_error)
            raise e from None
        log.warning("the publish's export failed on rank 0 (%s: %s); drained its %d remaining tensor(s) so the "
                    "other trainer ranks finish the export", type(e).__name__, e, n)
        raise


#: the share of the trainer GPU's free memory device buckets may take; the rest stays for what runs during the
#: stall (a recovery strategy's forward, the next step's start)
DEVICE_SHARE = 0.5


def device_budget(device: torch.device, share: float = DEVICE_SHARE, reserve: int = 0) -> int:
    """Bytes of device buckets the trainer's GPU can hold now: :data:`DEVICE_SHARE` of its free memory less
    ``reserve`` (what the weight sender allocates on the same GPU while it sends: its staging buffer and one host
    bucket, megarl/rollout/broadcast_sender.py). The blocks the trainer's allocator caches are not counted: the
    sender, another process, cannot use them, and the trainer's next step takes them back."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(int(share * free) - reserve, 0)


def pack_export(named_tensors, bucket_bytes: int, device: torch.device | None = None,
                budget: int = 0, alloc=None) -> tuple[list, list]:
    """``(send buckets, host buckets)`` of an export, both ``(meta rows, meta bytes, payload)`` in the same order.

    ``device`` None: every bucket in host shared memory, the same list twice. Otherwise the buckets go
    to ``device`` while they fit ``budget`` bytes, the others to host shared memory; the host list
    holds those and a pinned copy of each device bucket (pinned where CUDA is, so the copies run
    asynchronously; plain host memory on a CPU-only test of the same flow). ``alloc``: the shared buffers of
    the host buckets (:func:`pack_shared`).
    """
    send, on_device, used = [], [], 0
    for group in group_tensors(named_tensors, bucket_bytes):
        size = payload_bytes(group)
        here = device is not None and used + size <= budget
        send.append(pack(group, device, share=False) if here else
                    pack(group, torch.device("cpu"), share=True, alloc=alloc))
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


def recorded_dtype(hf: dict) -> str:
    return hf.get("dtype") or hf.get("torch_dtype") or "float32"


def engine_weights(trainer, engine_dtype: str | None) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """The trainer's HF tensors as the engines take them, and the config.json that says what they are.

    With ``engine_dtype`` other than the trainer's (``rollout.dtype``: bf16 engines beside an fp32
    trainer), each floating-point tensor is cast as it leaves the export, so the engines receive (and the
    disk copy holds) their own precision and nothing is cast again on their side. A collective on a
    multi-rank trainer, like ``export_hf_weights``.
    """
    tensors, hf = stream_engine_weights(trainer, engine_dtype)
    return consume_export(tensors, list), hf


def stream_engine_weights(trainer, engine_dtype: str | None, *, to_host: bool = True) -> tuple[CollectiveExport,
                                                                                                dict]:
    """:func:`engine_weights` as a stream, one tensor at a time; ``to_host=False``: left on the trainer's
    device (``export_hf_weights(to_host=False)``). Consume it with
    :func:`~megarl.rollout.export_buckets.consume_export`: a consumer that fails half-way must not leave
    the other trainer ranks in the export's gathers."""
    hf = dict(trainer.exported_hf_config())  # a copy: the trainer's own config stays as it is
    exported = trainer.export_hf_weights() if to_host else trainer.export_hf_weights(to_host=False)
    if not engine_dtype or engine_dtype == recorded_dtype(hf):
        return CollectiveExport(exported), hf
    target = getattr(torch, engine_dtype)
    for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["dtype"]:
        hf[key] = engine_dtype
    return CollectiveExport(exported, lambda t: t.to(target) if t.is_floating_point() else t), hf


def pack_shared(tensors: list, bucket_bytes: int, alloc=None) -> list:
    """The tensors packed into shared-memory buckets, emptying ``tensors`` as they are packed: host memory
    holds one copy of the model plus one bucket at most, not two copies. ``alloc``: where the buffers come
    from (a lease of megarl/rollout/bucket_pool.py; None: new ones)."""
    return list(iter_buckets(_emptied(tensors), bucket_bytes, share=True, alloc=alloc))


def shard_buckets(buckets: list, rule: ShardRule, k: int, *, consume: bool = False, alloc=None) -> list:
    """``(shard, meta rows, meta bytes, payload)`` to send: each bucket of ``buckets`` (``(rows, meta bytes,
    payload)``) cut into one bucket per engine worker (megarl/rollout/engine_shards.py), in bucket order and
    worker order within, so the k workers load side by side. Packed where the payload lives (host payloads
    in shared memory, for the sender process). ``consume``: ``buckets`` is emptied as it is cut, so each of
    its payloads can go once cut (device buckets: one bucket more at a time, not the model twice). ``alloc``:
    the host buckets' shared buffers (:func:`pack_shared`)."""
    out = []
    for rows, _meta, payload in (_emptied(buckets) if consume else iter(buckets)):
        named = list(unpack(rows, payload))
        for t in range(k):
            host = payload.device.type == "cpu"
            out.append((t, *pack(shard_rows(named, rule, t), payload.device, share=host,
                                 alloc=alloc if host else None)))
        del named, payload
    return out


def _emptied(items: list) -> Iterator:
    """``items`` in order, each removed from the list as it is taken."""
    items.reverse()
    while items:
        yield items.pop()
