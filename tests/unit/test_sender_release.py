"""The weight sender keeps no bucket of a publish once it has sent it.

Under NCCL the buckets are CUDA IPC handles into the trainer's GPU memory: while the sender process still
references one, torch cannot free the trainer's block, so a sender that held the last publish's buckets until the
next one kept up to a whole model's worth of device buckets through the next train step. Here the sender's loop
(megarl/rollout/broadcast_sender.py ``_serve``) runs in a thread with a recording group in place of the
broadcast's process group (a stand-in: only the loop's references are under test; the real group is
tests/e2e/test_broadcast.py's), which keeps a weak reference to every payload it was handed; once the sender
reports the publish done, none of them may be alive.
"""
import gc
import threading
import weakref

import torch
import torch.multiprocessing as tmp

from megarl.rollout.broadcast_sender import _serve


class RecordingGroupStandIn:
    """What ``_serve`` makes its group with; it records weak references to the payloads it sends."""

    seen: list = []

    def __init__(self, host, port, world_size, *, backend, timeout_s, group_id, secret, serve_rendezvous, shards):
        self.group_id = group_id

    def connect(self) -> None:
        pass

    def send_bucket(self, meta, payload, shard) -> None:
        RecordingGroupStandIn.seen.append(weakref.ref(payload))

    def end_stream(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_sender_drops_every_bucket_once_the_publish_is_sent():
    RecordingGroupStandIn.seen = []
    parent, child = tmp.get_context("spawn").Pipe()
    loop = threading.Thread(target=_serve, args=(child, RecordingGroupStandIn, None), daemon=True)
    loop.start()
    info = {"host": "127.0.0.1", "port": 0, "world_size": 2, "backend": "gloo", "timeout_s": 5.0,
            "group_id": "g1", "secret": "s"}
    parent.send(("open", info, 3))
    replies = [parent.recv()]
    for i in range(3):  # one bucket per message, as SenderProcess.send hands them
        parent.send(("bucket", bytes(8), torch.full((1024,), float(i)), 0))
        replies.append(parent.recv())
    parent.send(("end",))
    replies.append(parent.recv())
    assert [r[0] for r in replies] == ["joined", "bucket", "bucket", "bucket", "done"]
    gc.collect()
    alive = [ref for ref in RecordingGroupStandIn.seen if ref() is not None]
    assert len(RecordingGroupStandIn.seen) == 3
    assert not alive, f"the sender still holds {len(alive)} of the publish's 3 buckets after reporting it done"
    parent.send(("close",))
    loop.join(5.0)
    assert not loop.is_alive()
