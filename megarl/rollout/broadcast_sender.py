"""The trainer's end of the weight broadcast, in a process of its own that the trainer can kill.

A collective that fails is survivable with gloo (an exception the publisher
catches), not with NCCL: when a peer is lost, NCCL's watchdog tears the
process holding the communicator down before any ``except`` runs, and
``work.wait()`` returns once the work is queued, not delivered. So the
trainer never holds the broadcast's communicator. A :class:`SenderProcess`
(spawned, so CUDA is safe in it) does: the trainer hands it the packed
buckets (shared memory on CPU, CUDA IPC handles on GPU: no copy), and waits
for each step's acknowledgement (joining the group, then each bucket, then
the end marker) with a deadline of ``timeout_s``. On CUDA a bucket is
acknowledged only once it has left the GPU (megarl/rollout/weight_sync.py).

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

log = logging.getLogger("megarl.publish")


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

    def alive(self) -> bool:
        return self.proc.is_alive() and (self._busy is None or self._busy.done())

    def send(self, group_info: dict, buckets: list, timeout_s: float) -> concurrent.futures.Future:
        """Broadcast ``buckets`` (``(meta bytes, payload, shard)``: the workers of that shard receive it) in the
        group ``group_info`` names.

        Returns a future of the sender's seconds; it fails with :class:`EngineError` (and the sender
        is killed) when a step misses ``timeout_s``, fails, or the sender dies.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._busy = fut
        # the watcher lets go of the buckets once they are handed over: a failure's traceback, which the future
        # keeps until the next publish, would otherwise hold a whole export (its shared memory) through it
        message, steps = [("send", group_info, buckets)], len(buckets) + 2  # joined, each bucket, done
        del buckets

        def run() -> None:
            try:
                first = shared_fd_key()
                self._conn.send(message.pop())  # pickling shares each bucket's fd (claimed when the sender reads)
                self._shares = (first, shared_fd_key())
                for step in range(steps):
                    msg = self._recv(timeout_s, step, steps)
                    if msg[0] == "error":
                        raise EngineError(f"weight sender failed: {msg[1]}")
                    if msg[0] == "done":
                        fut.set_result(msg[1])
                        return
                raise EngineError("weight sender sent more steps than buckets")
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting publisher
                self.kill()
                fut.set_exception(e)

        threading.Thread(target=run, name="megarl-weight-sender-watch", daemon=True).start()
        return fut

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
    """The sender's loop: one message per publish, one acknowledgement per step."""
    if device_index is not None:
        torch.cuda.set_device(device_index)
    group = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the trainer is gone
            break
        if msg[0] == "close":
            break
        _, info, buckets = msg
        del msg  # the buckets are referenced by name only, so that dropping the name releases them
        try:
            t0 = time.perf_counter()
            if group is None or group.group_id != info["group_id"]:
                if group is not None:
                    group.close()
                # the trainer serves the group's rendezvous (megarl/rollout/rendezvous.py); this process joins it
                group = broadcaster_cls(info["host"], int(info["port"]), int(info["world_size"]),
                                        backend=info["backend"], timeout_s=float(info["timeout_s"]),
                                        group_id=info["group_id"], secret=info["secret"], serve_rendezvous=False,
                                        shards=int(info.get("shards", 1)))
                group.connect()
            conn.send(("joined",))
            while buckets:  # each bucket let go once sent: CUDA IPC blocks the trainer frees after the publish
                meta, payload, shard = buckets.pop(0)
                group.send_bucket(torch.frombuffer(bytearray(meta), dtype=torch.uint8), payload, shard)
                del meta, payload
                conn.send(("bucket",))
            group.end_stream()
            del buckets
            conn.send(("done", time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - reported, then the process ends
            try:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            finally:
                os._exit(1)  # sockets close with the process: engines still receiving fail now
    if group is not None:
        group.close()
