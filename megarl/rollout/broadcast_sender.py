"""The trainer's end of the weight broadcast, in a process of its own that the trainer can kill.

A collective that fails is survivable with gloo (an exception the publisher
catches), not with NCCL: when a peer is lost, NCCL's watchdog tears the
process holding the communicator down before any ``except`` runs, and
``work.wait()`` returns once the work is queued, not delivered. So the
trainer never holds the broadcast's communicator. A :class:`SenderProcess`
(spawned, so CUDA is safe in it) does. The trainer hands it one bucket per
message and the next only once the sender acknowledged the last (the ack
comes after the sender let go of it), with a deadline of ``timeout_s`` on
each step (joining the group, each bucket, the end marker). On CUDA a bucket
is acknowledged only once it has left the GPU (megarl/rollout/weight_sync.py).

What the sender may hold of the trainer's memory is bounded so that a sender
killed at any point leaves the trainer where it was:

* host buckets (shared memory) are handed as file-descriptor shares, one at
  a time; a share the sender had not claimed when it died is closed by
  :meth:`SenderProcess.kill`, and the one it held is freed with its process.
* device buckets are never shared with the sender: torch keeps a CUDA block
  the trainer shared alive for as long as the trainer lives once the consumer
  died holding it (its IPC reference count is never decremented), so a
  sender killed holding a view would leak that bucket for good. Instead the
  sender allocates a staging buffer on the trainer's GPU in its own process
  and shares it with the trainer; the trainer copies each device bucket into
  it (a device-to-device copy, then a synchronisation) and the sender
  broadcasts from its own memory. A dead sender's staging buffer is freed
  once the trainer drops its view (:meth:`SenderProcess.kill` does).

A sender that misses a deadline, fails, or dies (an NCCL abort) is killed,
and the publisher sets the abort mark of the group's rendezvous, which the
trainer process serves (megarl/rollout/rendezvous.py): engines still
receiving leave at once (under gloo the sender's sockets closing tells them
as well; under NCCL only the mark does, megarl/rollout/receiver_group.py),
the publisher falls back to the disk copy, and the next publish starts a
fresh sender. The trainer process itself is never touched by a lost engine.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from multiprocessing import resource_sharer

import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reducers that share memory, not copy it

from megarl.errors import EngineError

log = logging.getLogger("megarl.rollout.publish")


class SenderProcess:
    """A spawned process that owns the broadcast group and sends what it is handed, step by step.

    ``broadcaster_cls``: the :class:`~megarl.rollout.weight_sync.WeightBroadcaster` (or a subclass,
    importable by name) the sender makes its group with. ``device_index``: the CUDA device the
    sender uses (the trainer rank's own), None on CPU.
    """

    def __init__(self, broadcaster_cls, device_index: int | None = None) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, broadcaster_cls, device_index),
                                name="megarl-weight-sender", daemon=True)
        self.proc.start()
        child.close()
        self._busy: concurrent.futures.Future | None = None
        self._shares = (0, 0)  # the fd shares of the last message (unclaimed_shares)
        #: the sender's staging buffer on the trainer's GPU, as this process sees it (module doc)
        self._staging: torch.Tensor | None = None
        self._stage_timeout_s = 60.0

    def alive(self) -> bool:
        return self.proc.is_alive() and (self._busy is None or self._busy.done())

    def send(self, group_info: dict, buckets: list, timeout_s: float) -> concurrent.futures.Future:
        """Broadcast ``buckets`` (``(meta bytes, payload, shard)``: the workers of that shard receive it) in the
        group ``group_info`` names, one message per bucket (module doc).

        Returns a future of the sender's seconds; it fails with :class:`EngineError` (and the sender
        is killed) when a step misses ``timeout_s``, fails, or the sender dies. ``buckets`` is emptied as
        the buckets are handed over: a failure's traceback, which the future keeps until the next publish,
        would otherwise hold a whole export through it.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._busy = fut
        pending = list(buckets)
        buckets.clear()

        def run() -> None:
            try:
                self._stage(max((p.numel() * p.element_size() for _, p, _ in pending if p.device.type == "cuda"),
                                default=0))
                self._step(("open", group_info, len(pending)), timeout_s, 0, len(pending) + 2)
                for i in range(len(pending)):
                    meta, payload, shard = pending[i]
                    pending[i] = None  # handed over: this thread holds it no more than the sender does
                    self._step(self._bucket_message(meta, payload, shard), timeout_s, i + 1, len(pending) + 2)
                    del meta, payload
                fut.set_result(self._step(("end",), timeout_s, len(pending) + 1, len(pending) + 2)[1])
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting publisher
                pending.clear()
                self.kill()
                fut.set_exception(e.with_traceback(None))  # its frames would hold the bucket in flight

        threading.Thread(target=run, name="megarl-weight-sender-watch", daemon=True).start()
        return fut

    def _stage(self, n: int) -> None:
        """A staging buffer of at least ``n`` bytes in the sender (module doc), made once for the largest device
        bucket of a publish."""
        if n and (self._staging is None or self._staging.numel() < n):
            self._staging = None  # let go of the old buffer first: the sender frees it before it makes the new one
            self._staging = self._step(("stage", n), self._stage_timeout_s, 0, 1)[1]

    def _bucket_message(self, meta: bytes, payload: torch.Tensor, shard: int) -> tuple:
        """A host bucket as a shared-memory share; a device bucket copied into the sender's staging buffer
        (module doc), which the message then names by its byte count."""
        if payload.device.type != "cuda":
            return ("bucket", meta, payload, shard)
        n = payload.numel() * payload.element_size()
        self._staging[:n].copy_(payload.view(-1).view(torch.uint8))
        torch.cuda.synchronize(payload.device)  # the bytes are in place before the sender reads them
        return ("staged", meta, n, shard)

    def _step(self, message: tuple, timeout_s: float, step: int, steps: int):
        """Send ``message``, return the sender's answer (an error it reports is raised)."""
        first = shared_fd_key()
        self._conn.send(message)  # pickling a host bucket shares its fd (claimed when the sender reads it)
        self._shares = (first, shared_fd_key())
        del message
        msg = self._recv(timeout_s, step, steps)
        if msg[0] == "error":
            raise EngineError(f"weight sender failed: {msg[1]}")
        return msg

    def _recv(self, timeout_s: float, step: int, steps: int):
        if not self._conn.poll(timeout_s):
            raise EngineError(f"weight broadcast step {step + 1} of {steps} past its {timeout_s:g} s deadline "
                              "(an engine lost or stalled); sender killed")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(5.0)
            raise EngineError(f"weight sender died at step {step + 1} of {steps} (exit code {self.proc.exitcode}; "
                              "NCCL aborts the process that holds a failed communicator)") from None

    def kill(self) -> None:
        """Stop the sender now; the group's sockets close with it. The shares of a message it had not read yet
        are closed (:func:`close_unclaimed_shares`): they would hold that publish's shared memory for good."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self._conn.close()
        close_unclaimed_shares(*self._shares)
        self._staging = None  # the dead sender's buffer is freed once no process maps it

    def close(self) -> None:
        """Let an idle sender leave its group cleanly; kill it otherwise."""
        if self.alive():
            try:
                self._conn.send(("close",))
                self.proc.join(5.0)
            except OSError:
                pass
        self.kill()


def shared_fd_key() -> int:
    """The key of the newest file descriptor this process offered another one (multiprocessing's resource
    sharer, which torch's ``file_descriptor`` sharing of CPU tensors goes through)."""
    return resource_sharer._resource_sharer._key


def close_unclaimed_shares(first: int, last: int) -> int:
    """Close the offered descriptors with keys in ``(first, last]`` that no process fetched; how many.

    Sending a shared-memory tensor to another process offers a duplicate of its descriptor, which the
    resource sharer keeps open until the receiver fetches it while unpickling. A sender killed before it
    read its message never fetches them, and each duplicate then keeps its bucket's shared memory for the
    life of this process. multiprocessing has no public call for this: its private ``_cache`` (key ->
    (send, close)), ``_key`` and ``_lock`` are used here, and tests/unit/test_publish_memory.py fails if
    they change."""
    sharer = resource_sharer._resource_sharer
    with sharer._lock:
        gone = [sharer._cache.pop(k) for k in range(first + 1, last + 1) if k in sharer._cache]
    for _send, close in gone:
        close()
    return len(gone)


def _serve(conn, broadcaster_cls, device_index: int | None) -> None:
    """The sender's loop: ``open`` joins the group, each ``bucket`` or ``staged`` message sends one bucket,
    ``end`` ends the stream; one acknowledgement each, sent once the bucket is let go of."""
    if device_index is not None:
        torch.cuda.set_device(device_index)
    group, staging, t0 = None, None, 0.0
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the trainer is gone
            break
        kind = msg[0]
        if kind == "close":
            break
        try:
            if kind == "stage":  # a buffer of this process the trainer copies device buckets into
                staging = None
                torch.cuda.ipc_collect()  # the old one: the trainer let go of its view before asking
                staging = torch.empty(int(msg[1]), dtype=torch.uint8, device=torch.device("cuda", device_index))
                conn.send(("stage", staging))
            elif kind == "open":
                t0 = time.perf_counter()
                group = _joined(group, broadcaster_cls, msg[1])
                conn.send(("joined",))
            elif kind == "end":
                group.end_stream()
                conn.send(("done", time.perf_counter() - t0))
            else:
                _, meta, payload, shard = msg
                del msg  # the bucket is referenced by name only, so that dropping the name releases it
                if kind == "staged":
                    payload = staging[:payload]
                group.send_bucket(torch.frombuffer(bytearray(meta), dtype=torch.uint8), payload, shard)
                del payload  # let go of before the acknowledgement: the trainer hands the next bucket on it
                conn.send(("bucket",))
        except Exception as e:  # noqa: BLE001 - reported, then the process ends
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            finally:
                os._exit(1)  # sockets close with the process: engines still receiving fail now
    if group is not None:
        group.close()


def _joined(group, broadcaster_cls, info: dict):
    """The group ``info`` names: ``group`` when it is that one, else a new one joined (the old one closed)."""
    if group is not None and group.group_id == info["group_id"]:
        return group
    if group is not None:
        group.close()
    # the trainer serves the group's rendezvous (megarl/rollout/rendezvous.py); this process joins it
    group = broadcaster_cls(info["host"], int(info["port"]), int(info["world_size"]), backend=info["backend"],
                            timeout_s=float(info["timeout_s"]), group_id=info["group_id"], secret=info["secret"],
                            serve_rendezvous=False, shards=int(info.get("shards", 1)))
    group.connect()
    return group
