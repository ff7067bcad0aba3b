"""The dedicated strategy's line to its scoring process: one message protocol over two transports.

Messages, trainer -> scorer::

    ("version", (v, hf_dir))   load version v from an HF checkpoint directory
    ("score", jobs)            score these segments with the loaded version
    ("state", None)            reply with the loaded version
    ("stop", None)             finish and exit

Replies, scorer -> trainer: ``("ready", None)`` once the model is built,
``("loaded", v)``, ``("scored", results)``, ``("lost", [(key, seg_version,
scorer_version), ...])``, ``("state", v)`` and ``("error", traceback_text)``.

Transports (the strategy sees only :class:`QueueLink` / :class:`TcpLink`,
both with ``put``, ``get``, ``alive``, ``failure`` and ``close``; ``get``
never waits longer than its timeout, also when the other end dies half way
through a message):

* a child process spawned beside trainer rank 0, over two multiprocessing
  queues (one machine);
* a scorer started by its own command on its own node (``MEGARL_ROLE=dedicated``),
  over a TCP connection from :mod:`multiprocessing.connection`. Messages are
  pickled, so the connection is authenticated: both ends hold the same key,
  ``MEGARL_DEDICATED_AUTHKEY`` (``megarl launch`` makes a random one per run
  and hands it to both through the environment, never a command line; each
  takes it at start and removes it, megarl/isolation/secret_env.py), and the listener
  refuses a client whose key differs before reading any message from it. The
  handshakes have deadlines and the scorer's reads time out
  (recovery/_dedicated_listener.py): the trainer sends a heartbeat when idle.

Each end of the TCP connection reads in a thread of its own into an in-memory
queue, and the trainer end also sends from a thread: a send never waits for
the other side to get round to reading (the scorer is busy for the length of a
forward, the trainer for the length of a train step), so the two ends cannot
block each other with full socket buffers, and a send from the trainer's event
loop returns at once, as ``Queue.put`` does.
"""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

from megarl.errors import ConfigError, ScorerError
from megarl.isolation.secret_env import DEDICATED_AUTHKEY_ENV, take_secret
from recovery._dedicated_listener import HANDSHAKE_TIMEOUT_S, HEARTBEAT_S, client_handshake

#: what a lost scorer's error adds: the run stops, and where it goes on from
RESUME_HINT = "; `megarl train --resume RUN_DIR` continues from the run's newest checkpoint"

AUTHKEY_ENV = DEDICATED_AUTHKEY_ENV
_CLOSE = object()


def authkey_from_env(env: Any = None) -> bytes:
    """The shared key of the TCP link (without ``env``: this process's, taken once, megarl/isolation/secret_env.py); a
    ConfigError saying how to set it when it is missing."""
    key = take_secret(AUTHKEY_ENV) if env is None else env.get(AUTHKEY_ENV, "")
    if not key:
        raise ConfigError(f"{AUTHKEY_ENV} is not set: the trainer and the dedicated scorer authenticate their "
                          f"connection with it. `megarl launch` sets it for both; when starting them by hand, "
                          f"export the same value (e.g. `openssl rand -hex 16`) for both")
    return key.encode()


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"MEGARL_DEDICATED_ADDR={addr!r} is not host:port")
    return host, int(port)


def _get(q: Any, timeout: float | None) -> tuple | None:
    """One message from ``q`` (waiting up to ``timeout``; None or 0 = don't wait), None when none came."""
    try:
        return q.get(timeout=timeout) if timeout else q.get_nowait()
    except queue.Empty:
        return None


class QueueLink:
    """A spawned child process and its two multiprocessing queues.

    A thread of its own reads the child's queue into an in-memory one, so that
    :meth:`get` never waits longer than its timeout: a queue's read waits only
    for the first byte of a message and then for the rest without a limit, and
    no end of file ends it when the child dies half way through a reply (this
    process holds the pipe's write end too). That thread may stay blocked on
    such a reply; :meth:`alive` turns False once the child has been dead for
    ``grace_s`` (time for its last whole messages to be read) and :meth:`failure`
    names its exit code.
    """

    def __init__(self, proc: Any, in_q: Any, out_q: Any, grace_s: float = 1.0) -> None:
        self.proc, self.in_q, self.out_q = proc, in_q, out_q
        self._grace_s = grace_s
        self._dead_since: float | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._recv_loop, name="megarl-dedicated-recv", daemon=True)
        self._reader.start()

    def _recv_loop(self) -> None:
        while not self._closing.is_set():
            try:
                msg = self.out_q.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):  # the queue was closed
                return
            self._inbox.put(msg)

    def put(self, msg: tuple) -> None:
        self.in_q.put(msg)

    def get(self, timeout: float | None) -> tuple | None:
        return _get(self._inbox, timeout)

    def alive(self) -> bool:
        if self.proc.is_alive():
            return True
        if self._dead_since is None:
            self._dead_since = time.monotonic()
        return time.monotonic() - self._dead_since < self._grace_s

    def failure(self) -> Exception:
        return ScorerError(f"dedicated scoring process died (exit code {self.proc.exitcode}){RESUME_HINT}")

    def close(self, stop: bool) -> None:
        if stop:  # else it is still building its model: nothing to finish
            self.in_q.put(("stop", None))
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=10)
        self._closing.set()
        self._reader.join(timeout=1)  # it checks every 0.2 s (unless blocked on a dead child's broken reply)
        for q in (self.in_q, self.out_q):
            q.close()
            q.join_thread()


class TcpLink:
    """A client connection to a scorer role at ``addr``, made in the background.

    The connection is retried until ``connect_timeout_s`` (the role may still
    be starting); messages put meanwhile wait in the send queue, as they wait
    in a queue for a child that is still starting.
    """

    def __init__(self, addr: str, authkey: bytes, connect_timeout_s: float, retry_s: float = 1.0) -> None:
        self.addr = addr
        self._target = split_addr(addr)
        self._authkey = authkey
        self._deadline = time.monotonic() + connect_timeout_s
        self._timeout_s = connect_timeout_s
        self._retry_s = retry_s
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self._conn: Connection | None = None
        self._failure: Exception | None = None
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="megarl-dedicated-send", daemon=True)
        self._sender.start()

    # -- background threads ------------------------------------------------------------
    def _connect(self) -> Connection | None:
        last = None
        while not self._closing.is_set():
            try:
                remaining = self._deadline - time.monotonic()
                return client_handshake(self._target, self._authkey, max(0.05, min(HANDSHAKE_TIMEOUT_S, remaining)))
            except AuthenticationError:
                self._failure = ConfigError(
                    f"the dedicated scorer at {self.addr} refused the connection: {AUTHKEY_ENV} differs between "
                    f"the trainer and the scorer; give both the same value")
                return None
            except (OSError, EOFError) as e:  # not listening yet, or it went away during the handshake
                last = e
            if time.monotonic() > self._deadline:
                self._failure = ScorerError(f"dedicated scorer at {self.addr} did not accept a connection within "
                                             f"{self._timeout_s:g} s (recovery.dedicated.start_timeout_s); "
                                             f"last error: {last!r}")
                return None
            self._closing.wait(self._retry_s)
        return None

    def _send_loop(self) -> None:
        conn = self._connect()
        if conn is None:
            return
        self._conn = conn
        threading.Thread(target=self._recv_loop, args=(conn,), name="megarl-dedicated-recv", daemon=True).start()
        while True:
            try:
                msg = self._outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:  # nothing to say: tell the scorer this host is still there
                msg = ("ping", None)
            if msg is _CLOSE:
                return
            try:
                conn.send(msg)
            except (OSError, ValueError) as e:
                self._lost(f"sending to the dedicated scorer at {self.addr} failed: {e!r}")
                return

    def _recv_loop(self, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._lost(f"the dedicated scorer at {self.addr} closed the connection")
                return
            self._inbox.put(msg)

    def _lost(self, why: str) -> None:
        if self._failure is None and not self._closing.is_set():
            self._failure = ScorerError(why + RESUME_HINT)

    # -- the strategy's side -------------------------------------------------------------
    def put(self, msg: tuple) -> None:
        self._outbox.put(msg)

    def get(self, timeout: float | None) -> tuple | None:
        return _get(self._inbox, timeout)

    def alive(self) -> bool:
        if self._failure is None and self._conn is None and time.monotonic() > self._deadline + 1.0:
            self._failure = ScorerError(f"dedicated scorer at {self.addr} did not complete the connection within "
                                        f"{self._timeout_s:g} s (recovery.dedicated.start_timeout_s)")
        return self._failure is None

    def failure(self) -> Exception:
        self.alive()
        return self._failure or ScorerError(f"dedicated scorer at {self.addr}: connection closed{RESUME_HINT}")

    def close(self, stop: bool) -> None:
        """Send ``stop`` (when asked) after everything queued, then close; the scorer exits on either."""
        if stop:
            self._outbox.put(("stop", None))
        self._outbox.put(_CLOSE)
        if self._conn is None:  # still connecting: give up on it
            self._closing.set()
        self._sender.join(timeout=30)
        self._closing.set()
        self._sender.join(timeout=5)
        if self._conn is not None:
            hang_up(self._conn)


def hang_up(conn: Connection) -> None:
    """Close ``conn`` so that the other end sees it at once.

    A plain close does not end a connection that a reading thread of this
    process is blocked on (the read holds the socket open); shutting it down
    first sends the end of stream and wakes that read.
    """
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or never connected
        pass
    conn.close()
