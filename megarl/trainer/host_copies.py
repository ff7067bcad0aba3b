"""Kept host copies of a rank's parameters: one flat buffer per copy, reused, filled off the critical path.

snapshot and interrupt_sync keep a host copy of the weights at every publish
(``trainer.keep_params``) and free one when no live token needs it any more
(``trainer.release_params``). A fresh host allocation per publish costs an
allocation and, on CUDA, a synchronous device-to-host copy on the step's
critical path. Here the buffer of a freed copy goes back to a pool and the next
kept copy reuses it (on CUDA it is pinned, allocated once), and on CUDA the
copy runs on a side stream: it overlaps whatever the trainer does next (the
engines' generation, the next batch's forward and backward) and only the next
write of the parameters waits for it (:meth:`HostCopyPool.before_write`: the
optimizer step, a swap), on the device, without blocking the host. A host read
of a copy (a checkpoint, a disk snapshot) first calls :meth:`HostCopyPool.ready`.

Each copy is ONE flat buffer, the tensors views into it at :data:`ALIGN`-byte
offsets (:func:`flat_layout`), pinned by registering it with CUDA
(``cudaHostRegister``) rather than allocated through torch's caching host
allocator, which rounds every allocation up to a power of two: pinned one
parameter at a time, a model's copy took about a third more than its bytes.
What a copy holds is :func:`copy_bytes` of its tensors, which the host memory
plan counts (megarl/launch/host_memory.py, ``pinned``); the pool's
``held_bytes`` is what it holds now, freed with the last view of a buffer.

On CPU the same calls copy synchronously into the same flat buffers, unpinned
(pinned memory needs a CUDA runtime): what the pool saves there is the
allocation. The pinning and the overlap are CUDA properties that only a GPU can
show (launch/gpu_check.sh, ``pinned_bytes``).
"""
from __future__ import annotations

import weakref
from typing import Iterable

import numpy as np
import torch

#: byte alignment of each tensor in a flat copy: a multiple of every dtype's size
ALIGN = 512


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def copy_bytes(tensor_bytes: Iterable[int]) -> int:
    """The bytes of one flat copy of tensors of ``tensor_bytes`` bytes each (each at an aligned offset)."""
    return sum(_aligned(int(n)) for n in tensor_bytes)


def flat_layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    """(each tensor's byte offset in a flat copy, the copy's bytes)."""
    offsets, total = [], 0
    for _n, t in named:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    return offsets, total


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat uint8 host buffer of exactly ``nbytes`` bytes; ``pin``: page-locked by ``cudaHostRegister`` (no
    power-of-two rounding; unregistered when the last view of it is gone, before its memory is freed)."""
    array = np.empty(max(nbytes, 1), dtype=np.uint8)
    if pin:
        err = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte host copy failed (cudaError {err}): the node "
                               f"may be out of lockable memory (ulimit -l, the host memory plan: megarl plan)")
        weakref.finalize(array, _unpin, array.ctypes.data)  # runs before numpy frees the memory
    return torch.from_numpy(array)[:nbytes]


class HostCopyPool:
    """Flat host buffers by size, reused across kept copies; copies on a side stream on CUDA."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list = []  # CUDA events of copies not yet known to be complete
        self._stream = None
        #: buffers allocated so far (a reused buffer is not counted again)
        self.allocated = 0
        #: bytes of the buffers that exist now (held by copies or free in the pool)
        self.held_bytes = 0
        self._ours: set[int] = set()  # data pointers of this pool's live buffers

    def _freed(self, ptr: int, nbytes: int) -> None:
        self._ours.discard(ptr)
        self.held_bytes -= nbytes

    def _buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocated += 1
        self.held_bytes += nbytes
        flat = host_buffer(nbytes, pin)
        ptr = flat.data_ptr()
        self._ours.add(ptr)
        # the views keep the buffer's storage (and its numpy array) alive: freed with the last of them
        weakref.finalize(flat.untyped_storage(), self._freed, ptr, nbytes)
        return flat

    def copy(self, named: Iterable[tuple[str, torch.Tensor]], pin: bool | None = None) -> dict[str, torch.Tensor]:
        """Host copies of ``named`` (name, tensor) as views of one flat buffer; asynchronous for CUDA tensors.
        ``pin``: page-lock the buffer (None: where a tensor is on CUDA)."""
        named = [(n, t.detach()) for n, t in named]
        offsets, total = flat_layout(named)
        flat = self._buffer(total, pin=any(t.is_cuda for _, t in named) if pin is None else pin)
        out = {n: flat[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
               for (n, t), off in zip(named, offsets)}
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
        """Give a kept copy's buffer back for the next one; the caller holds no other reference to its tensors.
        No wait: a copy still filling it runs on the side stream, before any later copy into it. A copy this
        pool did not make (one a checkpoint restored) is left to the garbage collector."""
        first = next(iter(params.values()), None)
        if first is None:
            return
        storage = first.untyped_storage()
        if storage.data_ptr() not in self._ours:
            return
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        nbytes = sum(_aligned(t.numel() * t.element_size()) for t in params.values())
        self._free.setdefault(nbytes, []).append(flat[:nbytes])

    def clear(self) -> None:
        """Drop the free buffers (their memory is freed, and unpinned, once no copy views them)."""
        self.ready()
        self._free.clear()

