"""The bucket format of a weight publish: named tensors packed into buckets of at most ``bucket_bytes``.

Each bucket is ``(meta rows, meta bytes, payload)``: rows ``[name, shape, dtype, offset]`` (+ ``[full
shape, dim, start]`` for one worker's slice, megarl/rollout/engine_shards.py), their JSON bytes, and a
uint8 payload holding every tensor at a 16-byte aligned offset. The broadcast
(megarl/rollout/weight_sync.py) sends these buckets and the receivers :func:`unpack` them; the export
(megarl/rollout/export_buckets.py) and the disk copy (megarl/rollout/disk_copy.py) read them too.
Nothing here talks to a process group.
"""
from __future__ import annotations

import json
import math
from typing import Iterable, Iterator

import torch

from megarl.rollout.weight_spec import dtype_name

_ALIGN = 16


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device=None, share: bool = False, alloc=None) -> Iterator[tuple[list, torch.Tensor, torch.Tensor]]:
    """Pack tensors into buckets of at most ``bucket_bytes``: ``(meta rows, meta bytes, payload)`` each.

    One tensor larger than ``bucket_bytes`` gets a bucket of its own (:func:`plan_buckets` says which
    tensors share one, and where each sits). ``device``: where each payload is assembled (None: where
    the first tensor of the bucket lives), so a GPU trainer packs on its GPU. ``share``: host payloads
    go to shared memory as they are made, so handing them to another process
    (megarl/rollout/broadcast_sender.py) copies nothing; ``alloc(nbytes)`` gives those shared buffers
    (reused ones: megarl/rollout/bucket_pool.py) instead of new ones.
    """
    for bucket in group_tensors(named_tensors, bucket_bytes):
        yield pack(bucket, device, share, alloc)


def group_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                  bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, in groups of one bucket each (:func:`plan_buckets`), holding one group at a time."""
    yield from _groups(((name, t.detach()) for name, t in named_tensors), lambda nt: _nbytes(nt[1]), bucket_bytes)


def plan_buckets(specs: Iterable[tuple[str, list, str]], bucket_bytes: int) -> list[tuple[list, int]]:
    """``(meta rows, payload bytes)`` of each bucket that tensors ``(name, shape, dtype name)`` are packed into,
    in order: consecutive tensors share a bucket while it stays within ``bucket_bytes`` (a larger tensor
    has one of its own); rows ``[name, shape, dtype, offset]``, each offset 16-byte aligned."""
    sized = [(name, list(shape), dtype, math.prod(shape) * getattr(torch, dtype).itemsize)
             for name, shape, dtype in specs]
    return [_rows(bucket) for bucket in _groups(sized, lambda spec: spec[3], bucket_bytes)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _groups(items, nbytes, bucket_bytes: int) -> Iterator[list]:
    bucket, size = [], 0
    for item in items:
        n = nbytes(item)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n + _ALIGN
    if bucket:
        yield bucket


def payload_bytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """The payload bytes :func:`pack` makes of ``bucket`` (each tensor 16-byte aligned)."""
    return _rows([(name, t.shape, dtype_name(t.dtype), _nbytes(t)) for name, t in bucket])[1]


def _rows(sized: list) -> tuple[list, int]:
    """Meta rows of one bucket's ``(name, shape, dtype, nbytes)``, and its payload bytes."""
    meta, offset = [], 0
    for name, shape, dtype, nbytes in sized:
        meta.append([name, list(shape), dtype, offset])
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return meta, offset


def pack(bucket: list[tuple[str, torch.Tensor]], device=None, share: bool = False,
         alloc=None) -> tuple[list, torch.Tensor, torch.Tensor]:
    """One bucket's ``(meta rows, meta bytes, payload)`` (:func:`iter_buckets`)."""
    meta, offset = _rows([(name, t.shape, dtype_name(t.dtype), _nbytes(t)) for name, t in bucket])
    for row, (_name, t) in zip(meta, bucket):
        if hasattr(t, "megarl_slice"):  # one worker's part (megarl/rollout/engine_shards.py)
            row.extend(t.megarl_slice)  # [full shape, dim, start]
    where = torch.device(device if device is not None else bucket[0][1].device)
    if share and where.type == "cpu" and alloc is not None:
        payload = alloc(offset)  # a shared buffer of a former publish: every tensor's bytes are written below
    else:
        payload = torch.empty(offset, dtype=torch.uint8, device=where)
        if share and payload.device.type == "cpu":
            payload.share_memory_()  # still empty: nothing to copy yet
    for (_name, t), row in zip(bucket, meta):
        off = row[3]
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        payload[off:off + flat.numel()].copy_(flat)
    meta_bytes = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return meta, meta_bytes, payload


def rows_bytes(meta: list) -> int:
    """The tensors' bytes in a bucket's meta rows (without alignment padding)."""
    total = 0
    for row in meta:
        total += math.prod(row[1]) * getattr(torch, row[2]).itemsize
    return total


def unpack(meta: list, payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of one bucket: views into ``payload`` (uint8) at the offsets of its meta rows.

    A row with a slice (``[..., full shape, dim, start]``: one worker's part, megarl/rollout/engine_shards.py)
    yields a zero tensor of the full shape holding the part at its place: the engine's own loader cuts
    that very part out of it again."""
    for row in meta:
        name, shape, dtype, offset = row[:4]
        dt = getattr(torch, dtype)
        part = payload[offset:offset + math.prod(shape) * dt.itemsize].view(dt).reshape(shape)
        if len(row) == 4:
            yield name, part
            continue
        full_shape, dim, start = row[4:]
        full = torch.zeros(full_shape, dtype=dt, device=payload.device)
        full.narrow(dim, start, shape[dim]).copy_(part)
        yield name, full
