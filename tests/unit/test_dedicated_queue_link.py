"""The dedicated strategy's link to a spawned scoring child (recovery/_dedicated_link.py's QueueLink): a child
that dies half way through a reply ends in a clear error within seconds, never in a read blocked forever."""
import multiprocessing as mp
import os
import signal
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler

from megarl.errors import ScorerError
from recovery import _dedicated_link as link


def _die_mid_reply(out_q, size: int) -> None:
    """A whole message, then the first KB of a ``size``-byte reply, then SIGKILL (what the queue's feeder
    thread leaves in the pipe when its process is killed while it writes a large reply)."""
    fd = out_q._writer.fileno()
    whole = bytes(ForkingPickler.dumps(("loaded", 3)))
    for data in (struct.pack("!i", len(whole)) + whole, struct.pack("!i", size) + b"\x80" * 1024):
        out_q._sem.acquire()  # as a put does: the reader's get releases it
        os.write(fd, data)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_killed_mid_reply_ends_in_a_clear_error_not_a_blocked_read():
    ctx = mp.get_context("spawn")
    in_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_die_mid_reply, args=(out_q, 27_000_000), daemon=True)
    proc.start()
    q = link.QueueLink(proc, in_q, out_q)
    got = []

    def drive() -> None:  # what the strategy's wait does (recovery/dedicated.py): read while the child lives
        while q.alive():
            msg = q.get(0.5)
            if msg is not None:
                got.append(msg)
        while (msg := q.get(None)) is not None:  # what is left once it died
            got.append(msg)

    t0 = time.monotonic()
    reader = threading.Thread(target=drive, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "a read blocked on the half-written reply"
    assert time.monotonic() - t0 < 10
    assert got == [("loaded", 3)], "the whole message before the broken one still arrives"
    # one clear error (the CLI prints a MegarlError as one line, no traceback) that says how the run goes on
    assert isinstance(q.failure(), ScorerError)
    assert str(q.failure()) == ("dedicated scoring process died (exit code -9); `megarl train --resume RUN_DIR` "
                                "continues from the run's newest checkpoint")
    q.close(stop=False)
