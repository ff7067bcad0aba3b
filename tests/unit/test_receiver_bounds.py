"""An engine's receive is bounded: it leaves at the publisher's abort mark, or after the step deadline.

Rank 0 (this process, a thread) forms the group and then sends nothing: a
trainer alive but silent, its rendezvous up. The gloo communicator's own
timeout is 2 * timeout_s + 30 s (receiver_group.communicator_timeout), so
what ends each wait here is the receiver's own bound. Each test runs both
waits: gloo's (a blocking ``wait(timeout)``) and the polling one NCCL takes
(``is_completed()``; leaving calls ``ProcessGroup.abort``), the latter over
the same gloo group, as NCCL cannot run here.
"""
import asyncio
import threading
import time

import pytest
import torch
from nccl_receive_fake import NcclLazyInitFake

from megarl.rollout.client import free_port
from megarl.rollout.receiver_group import POLL_S, BroadcastLeft, ReceiverGroup
from megarl.rollout.weight_sync import WeightBroadcaster, join_weight_group, receive_named_tensors

WAITS = pytest.mark.parametrize("wait", ["gloo", "nccl"], ids=["blocking-gloo", "polling-as-nccl"])


def _joined(timeout_s: float, wait: str, lazy_init: bool = False):
    """(rank 0's broadcaster, rank 1's group waiting as ``wait`` does): the group formed, nothing sent.
    ``lazy_init``: the receiver's first call sets a communicator up with a sender that never comes
    (nccl_receive_fake.NcclLazyInitFake)."""
    sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, backend="gloo", timeout_s=timeout_s)
    th = threading.Thread(target=sender.connect)
    th.start()
    group, _store, _device = join_weight_group(sender.group_info(rank=1))
    th.join(timeout=30)
    pg = NcclLazyInitFake(group.pg) if lazy_init else group.pg
    return sender, ReceiverGroup(pg, group.store, wait, group.timeout_s)


# in-communicator-init: NCCL only (gloo sets its group up when it is made, not in the first call)
@pytest.mark.parametrize("wait,lazy_init", [("gloo", False), ("nccl", False), ("nccl", True)],
                         ids=["blocking-gloo", "polling-as-nccl", "polling-as-nccl-in-communicator-init"])
def test_a_receiver_leaves_at_the_abort_mark_within_one_poll(wait, lazy_init):
    sender, group = _joined(60, wait, lazy_init)
    try:
        threading.Timer(0.3, sender.abort, args=("version 7: broadcast failed",)).start()
        t0 = time.monotonic()
        with pytest.raises(BroadcastLeft, match="version 7: broadcast failed"):
            group.broadcast(torch.empty(2, dtype=torch.int64), 0).wait()
        left_s = time.monotonic() - t0
        assert left_s < 0.3 + POLL_S + 0.5, left_s
        with pytest.raises(BroadcastLeft, match="left before"):  # a left group is not used again
            group.broadcast(torch.empty(2, dtype=torch.int64), 0)
    finally:
        sender.close()


@WAITS
def test_a_receiver_leaves_a_silent_trainer_after_the_step_deadline(wait):
    sender, group = _joined(2, wait)
    try:
        t0 = time.monotonic()
        with pytest.raises(BroadcastLeft, match="no data from the trainer for 2 s"):
            group.broadcast(torch.empty(2, dtype=torch.int64), 0).wait()
        assert 2 <= time.monotonic() - t0 < 4
    finally:
        sender.close()


@WAITS
def test_a_receiver_leaves_when_the_rendezvous_is_gone(wait):
    sender, group = _joined(60, wait)
    try:
        threading.Timer(0.3, sender.rendezvous.close).start()
        t0 = time.monotonic()
        with pytest.raises(BroadcastLeft, match="the rendezvous is gone"):
            group.broadcast(torch.empty(2, dtype=torch.int64), 0).wait()
        assert time.monotonic() - t0 < 0.3 + POLL_S + 0.5
    finally:
        sender.close()


def test_the_first_call_is_bounded_when_the_sender_never_sets_up_the_communicator():
    """NCCL sets its communicator up inside the first collective call, which returns only once every rank
    came (nccl_receive_fake.NcclLazyInitFake: a real gloo barrier with the sender, which never joins it): the
    call is under the step deadline too, and the engine's update lock is free once the receive failed. The
    abort mark ends it as well (test_a_receiver_leaves_at_the_abort_mark_within_one_poll)."""
    sender, group = _joined(2, "nccl", lazy_init=True)
    lazy = group.pg

    async def update(lock: asyncio.Lock):
        async with lock:  # as the engines hold theirs over a weight update
            list(receive_named_tensors(group, torch.device("cpu")))

    async def run():
        lock = asyncio.Lock()
        with pytest.raises(BroadcastLeft, match=r"for 2 s \(.*\) while the communicator was set up"):
            await update(lock)
        return lock.locked()

    try:
        t0 = time.monotonic()
        assert asyncio.run(run()) is False
        assert lazy.entered.is_set() and not lazy.initialized
        assert 2 <= time.monotonic() - t0 < 2 + POLL_S + 1.5
    finally:
        sender.close()
