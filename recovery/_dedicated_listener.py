"""The dedicated link's sockets: authentication with a deadline, the scorer's listener, reads that time out.

The link carries pickles, so nothing is read from a connection before it has
proved the run's key (the HMAC challenge of :mod:`multiprocessing.connection`,
both ways). Every step of that handshake has a deadline (``SO_RCVTIMEO`` /
``SO_SNDTIMEO`` on the socket), on both ends:

* the scorer accepts in one thread and runs each handshake in a thread of its
  own, so a client that connects and then says nothing (or sends half a
  challenge) delays nobody: the run's trainer proves the key beside it and is
  served, the idle one is dropped at its deadline;
* the trainer's handshake ends by its connect deadline at the latest, so a
  port held by something that never answers fails the run then.

After the handshake the scorer's reads keep a deadline, ``peer_timeout_s``:
the trainer sends a heartbeat (``("ping", None)``, dropped by :func:`reader`)
every :data:`HEARTBEAT_S` seconds while it has nothing else to send, so a
silence that long means its host is gone without closing the connection
(power, network), and the scorer ends instead of waiting forever. TCP
keepalive is on as well, for the reads the heartbeat does not cover.
"""
from __future__ import annotations

import queue
import socket
import struct
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from typing import Callable

#: seconds between the trainer's heartbeats when it sends nothing else
HEARTBEAT_S = 5.0
#: seconds a connection has to prove the key once accepted
HANDSHAKE_TIMEOUT_S = 10.0
#: handshakes the scorer runs at once; connections past them are closed unread
MAX_PENDING_HANDSHAKES = 32


def set_io_timeout(conn: Connection, timeout_s: float | None) -> None:
    """Make every blocking read and write of ``conn`` fail (OSError) past ``timeout_s`` (None: wait forever)."""
    secs = 0.0 if timeout_s is None else max(timeout_s, 1e-3)
    tv = struct.pack("ll", int(secs), int((secs % 1) * 1e6))
    s = socket.socket(fileno=conn.fileno())
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    finally:
        s.detach()  # the fd stays conn's


def client_handshake(target: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """Connect to ``target`` and prove ``authkey`` both ways within ``timeout_s``: the trainer's end.
    AuthenticationError for a scorer with another key, OSError/EOFError for anything else."""
    sock = socket.create_connection(target, timeout=timeout_s)
    sock.settimeout(None)  # blocking, with the deadline below on each read and write
    conn = Connection(sock.detach())
    try:
        set_io_timeout(conn, timeout_s)
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        set_io_timeout(conn, None)  # the scorer may be busy for the length of a model load
    except BaseException:
        conn.close()
        raise
    return conn


def listen(port: int, host: str) -> Listener:
    """A TCP listener on ``host:port`` that authenticates nothing itself (:func:`accept_in_background` does)."""
    return Listener((host, port), backlog=16)


def accept_in_background(listener: Listener, authkey: bytes, log: Callable[[str], None],
                         handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> "queue.Queue[Connection]":
    """Accept connections until one proves ``authkey`` (it is put in the returned queue); each handshake runs in
    its own thread within ``handshake_timeout_s``, so an idle or slow connection delays no other. Connections
    that fail are logged and closed without a message read from them."""
    got: queue.Queue = queue.Queue(maxsize=1)
    done = threading.Event()
    slots = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)

    def prove(conn: Connection) -> None:
        try:
            set_io_timeout(conn, handshake_timeout_s)
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        except AuthenticationError:
            log("refused a connection with the wrong key (MEGARL_DEDICATED_AUTHKEY differs)")
            conn.close()
            return
        except (OSError, EOFError) as e:  # silent past the deadline, or hung up during the handshake
            log(f"dropped a connection that did not prove the key within {handshake_timeout_s:g} s: {e!r}")
            conn.close()
            return
        finally:
            slots.release()
        set_io_timeout(conn, None)
        try:
            got.put_nowait(conn)
        except queue.Full:  # another client proved the key first
            conn.close()
            return
        done.set()

    def run() -> None:
        while not done.is_set():
            try:
                conn = listener.accept()
            except OSError as e:
                if listener._listener is None:  # the listener was closed: the role is exiting
                    return
                log(f"a connection attempt failed: {e!r}")
                continue
            if done.is_set() or not slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=prove, args=(conn,), name="megarl-dedicated-handshake", daemon=True).start()

    threading.Thread(target=run, name="megarl-dedicated-accept", daemon=True).start()
    return got


def reader(conn: Connection, peer_timeout_s: float | None = None,
           log: Callable[[str], None] = lambda _: None) -> Callable[[], tuple]:
    """``recv()`` over a thread that keeps reading ``conn``; ("closed", None) once the trainer hangs up or has
    sent nothing, not even a heartbeat, for ``peer_timeout_s`` (None: no deadline). Heartbeats are dropped."""
    inbox: queue.Queue = queue.Queue()
    set_io_timeout(conn, peer_timeout_s)

    def run() -> None:
        while True:
            try:
                msg = conn.recv()
            except BlockingIOError:
                log(f"the trainer sent nothing for {peer_timeout_s:g} s (recovery.dedicated.peer_timeout_s): its "
                    f"host is gone; ending")
                inbox.put(("closed", None))
                return
            except (EOFError, OSError):
                inbox.put(("closed", None))
                return
            if msg != ("ping", None):
                inbox.put(msg)

    threading.Thread(target=run, name="megarl-dedicated-read", daemon=True).start()
    return inbox.get
