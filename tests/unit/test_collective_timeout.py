"""A trainer collective that waits for a rank that never comes (its node lost) fails after its timeout, and the run's
error says so and names trainer.collective_timeout_s (megarl/trainer/parallel.py). Two gloo ranks in one process:
rank 1 joins the group and never calls the collective, as a rank on a stopped host does.
tests/e2e/test_node_loss.py loses a real trainer node."""
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megarl.errors import CheckpointError
from megarl.trainer.parallel import lost_rank_error


def _two_ranks(timeout_s: float) -> list:
    store = dist.HashStore()
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups)
    return groups


def test_a_collective_without_its_peer_fails_after_the_timeout_and_the_error_names_the_key():
    rank0, _rank1 = _two_ranks(1.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        rank0.allreduce([torch.ones(1)]).wait()
    waited = time.monotonic() - t0
    assert 0.9 <= waited < 10, waited
    # as the run meets it: raised again while the run's resources close (an exception with the timeout as context)
    try:
        try:
            raise info.value
        except RuntimeError:
            raise ValueError("closing the run failed too")  # noqa: B904 - the implicit context an exit stack leaves
    except ValueError as closing:
        chained = closing
    quoted = CheckpointError(f"the background write of step 3 failed: rank 0: {info.value}")
    for exc in (info.value, chained, quoted):
        error = lost_rank_error(exc, 1.0, "/runs/r")
        assert error is not None, exc
        text = str(error)
        assert "waited trainer.collective_timeout_s=1 s in a collective for another trainer rank" in text
        assert "Timed out waiting 1000ms" in text and "a trainer node was lost" in text
        assert "/runs/r/checkpoints stands" in text and text.endswith("logging.resume=/runs/r")


def test_gloos_pair_closure_is_a_lost_rank_too():
    """What a gloo broadcast to a rank on a stopped host raises once the timeout has passed (seen on rank 0 of
    tests/e2e/test_node_loss.py): no 'gloo' in it, no DistBackendError."""
    error = lost_rank_error(RuntimeError("Application timeout caused pair closure"), 30.0, "/runs/r")
    assert error is not None
    assert "waited trainer.collective_timeout_s=30 s in a collective for another trainer rank (Application timeout " \
           "caused pair closure)" in str(error)


def test_other_errors_are_not_taken_for_a_lost_rank():
    for exc in (RuntimeError("CUDA out of memory"), TimeoutError("the engine timed out"),
                RuntimeError("timed out reading the dataset"), ValueError("gloo timeout")):
        assert lost_rank_error(exc, 1.0, "/runs/r") is None, exc


def test_after_a_timed_out_collective_the_followers_stop_is_not_sent(tmp_path):
    """Rank 0's run ends on a collective that timed out: closing it must not send the followers' final stop, a
    collective that would wait out trainer.collective_timeout_s once more (seen: 63 s to stop at a 30 s timeout).
    Any other error still sends it (the followers must not wait for events forever)."""
    import asyncio
    from contextlib import AsyncExitStack
    from types import SimpleNamespace

    from megarl.builder import Run
    from megarl.loop.spmd import DrivingTrainer

    class Channel:
        def __init__(self):
            self.lock, self.sent = threading.Lock(), []

        def send(self, event):
            self.sent.append(event)

    timed_out = RuntimeError("Application timeout caused pair closure")
    for exc, sent in ((timed_out, []), (ValueError("a reward failed"), [("stop", None)]), (None, [("stop", None)])):
        driver = DrivingTrainer(trainer=None, channel=Channel())
        stack = AsyncExitStack()
        stack.callback(driver.stop_followers)
        run = SimpleNamespace(trainer=driver, closing=stack, weights_dir=tmp_path / "weights")
        asyncio.run(Run.__aexit__(run, type(exc) if exc else None, exc, None))
        assert driver.channel.sent == sent, exc


def test_a_save_that_timed_out_on_a_lost_rank_is_not_a_failed_save_to_retry():
    """A background checkpoint's write waited trainer.collective_timeout_s for a rank on a lost node (seen: counted
    as 1 of logging.max_save_failures, the run went on and waited the timeout out once more in its next step):
    not a save failure, the run stops at once. A disk error still is one."""
    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.checkpoint.writer import is_save_failure

    sent = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 30000ms for send operation to "
                        "complete")
    assert not is_save_failure(sent)
    assert not is_save_failure(CheckpointException("save failed", {1: (sent, None)}))
    assert not is_save_failure(CheckpointError(f"the background write failed: rank 0: {sent}"))
    assert is_save_failure(OSError(28, "No space left on device"))
    assert is_save_failure(CheckpointException("save failed", {0: (OSError(28, "No space left on device"), None)}))
