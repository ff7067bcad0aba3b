"""Kept host copies of a rank's parameters: reused buffers, filled off the critical path.

snapshot and interrupt_sync keep a host copy of the weights at every publish
(``trainer.keep_params``) and free one when no live token needs it any more
(``trainer.release_params``). A fresh host allocation per publish costs an
allocation and, on CUDA, a synchronous device-to-host copy on the step's
critical path. Here the buffers of a freed copy go back to a pool and the next
kept copy reuses them (on CUDA they are pinned, allocated once), and on CUDA the
copy runs on a side stream: it overlaps whatever the trainer does next (the
engines' generation, the next batch's forward and backward) and only the next
write of the parameters waits for it (:meth:`HostCopyPool.before_write`: the
optimizer step, a swap), on the device, without blocking the host. A host read
of a copy (a checkpoint, a disk snapshot) first calls :meth:`HostCopyPool.ready`.

On CPU the same calls copy synchronously into the reused buffers: what the pool
saves there is the allocation. The overlap itself is a CUDA property that only a
GPU can show.
"""
from __future__ import annotations

from typing import Iterable

import torch


class HostCopyPool:
    """Host buffers by (shape, dtype), reused across kept copies; copies on a side stream on CUDA."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._pending: list = []  # CUDA events of copies not yet known to be complete
        self._stream = None
        #: buffers allocated so far (a reused buffer is not counted again)
        self.allocated = 0

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((tuple(like.shape), like.dtype))
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)

    def copy(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Host copies of ``named`` (name, tensor) in reused buffers; asynchronous for CUDA tensors."""
        named = [(n, t.detach()) for n, t in named]
        out = {n: self._buffer(t) for n, t in named}
        if not any(t.is_cuda for _, t in named):
            for n, t in named:
                out[n].copy_(t)
            return out
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # the values as of now, not as of the copy's start
        with torch.cuda.stream(self._stream):
            for n, t in named:
                out[n].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending.append(done)
        return out

    def before_write(self) -> None:
        """Called before the parameters change: the current stream waits for the copies still running."""
        for done in self._pending:
            torch.cuda.current_stream().wait_event(done)
        self._pending.clear()  # stream order now covers them for every later write and read on this stream

    def ready(self) -> None:
        """Block the host until every copy is complete (before the host reads one)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._pending.clear()

    def release(self, params: dict[str, torch.Tensor]) -> None:
        """Give a kept copy's buffers back for the next one; the caller holds no other reference to them. No
        wait: a copy still filling one of them runs on the side stream, before any later copy into it."""
        for t in params.values():
            self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def clear(self) -> None:
        """Drop the free buffers (their memory goes back to the allocator)."""
        self.ready()
        self._free.clear()
