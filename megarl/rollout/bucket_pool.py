"""Shared-memory send buckets reused from one publish to the next.

A broadcast publish packs the export into shared-memory buckets (megarl/rollout/export_buckets.py) that
the sender process broadcasts from and the disk copy writes from. Allocating them anew at every publish
costs the whole model in fresh shared-memory pages each time (the kernel zeroes every page on its first
touch: seconds per publish at tens of GB), and freeing them lets the node's shared memory swing by the
model's size at every publish. The export's layout is the same at every publish (the same tensors in the
same buckets), so the buckets of a version nobody reads any more serve the next one instead.

A version's export buckets are read by two holders: the sender, until ``apply`` has sent them, and the
disk copy, until its write ends (written, failed, stopped or dropped: megarl/rollout/disk_copy.py); the
buckets cut per engine worker only by the sender. A :class:`Lease` collects the buffers one ``prepare``
takes for one of those and gives them back to the pool only when all its holders have released it; a
holder that never releases only costs reuse, never a buffer overwritten while it is read (the sender
releases after its send completed or after it was killed). Shared memory then settles at what the memory
plan counts (the export of the version still written to disk, the next one and its cut copy:
megarl/launch/host_memory.py) and stays there between publishes; :meth:`SharedBucketPool.clear` (the
publisher's ``close``) lets it go.
"""
from __future__ import annotations

import threading

import torch

#: the holders of one version's buckets
SENDER, DISK = "sender", "disk"


class SharedBucketPool:
    """Free shared-memory byte buffers by size, and the leases that hold the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        #: buffers allocated / handed out again, and the bytes allocated
        self.n_allocated = self.n_reused = self.bytes_allocated = 0

    def lease(self, holders: tuple[str, ...] = (SENDER, DISK)) -> Lease:
        """Buffers of one version, held by ``holders`` (default: the sender and the disk copy)."""
        return Lease(self, holders)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.n_reused += 1
                return free.pop()
            self.n_allocated += 1
            self.bytes_allocated += nbytes
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()

    def _give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                self._free.setdefault(b.numel(), []).append(b)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for free in self._free.values() for b in free)

    def clear(self) -> None:
        """Drop the free buffers (leased ones go when their holders let go of them)."""
        with self._lock:
            self._free.clear()


class Lease:
    """The shared-memory buffers one ``prepare`` packed into, back to the pool once every holder released."""

    def __init__(self, pool: SharedBucketPool, holders: tuple[str, ...]) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._holders = set(holders)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A shared-memory uint8 buffer of ``nbytes`` for a bucket (``pack(alloc=...)``)."""
        buf = self._pool._take(nbytes)
        with self._lock:
            self._buffers.append(buf)
        return buf

    def release(self, holder: str) -> None:
        """``holder`` reads the buffers no more; the last release gives them back."""
        with self._lock:
            self._holders.discard(holder)
            done, buffers = not self._holders, self._buffers
            if done:
                self._buffers = []
        if done and buffers:
            self._pool._give(buffers)
