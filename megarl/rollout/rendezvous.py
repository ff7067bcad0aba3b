"""The weight broadcast's rendezvous: a key-value store only the run's processes can reach or write.

A broadcast group (megarl/rollout/weight_sync.py) needs a store where its
ranks post the addresses they listen on (gloo) or the communicator id (NCCL)
before the group exists. torch's ``TCPStore`` listens on every interface and
takes any client: anyone who reaches the port can write a key, and
``list_keys`` / ``get`` show every key and value, so a secret key prefix alone
would not keep a stranger out (he reads the prefix off the store).

Threat model: a stranger who can open TCP connections to the trainer node
(another user of a shared host, any host of the cluster network) but cannot
read the traffic between the run's own processes. He must not be able to
write a key the group reads (pose as a rank, point a rank at his own address
and receive the weights, or send it poisoned ones), read the ranks'
addresses, or pass himself off as the store to an engine. Out of scope: an
eavesdropper on the network (the engine key travels as a bearer token in the
clear as well), a stranger who only keeps the port busy (denial of service:
each refused connection costs a thread for at most the 10 s handshake), and
the data plane of gloo/NCCL itself, which authenticates nothing anywhere in
torch.distributed; the store is what tells the ranks where that data plane is.

So the store is megarl's own: a :class:`RendezvousServer` in the trainer
process that listens on one address (the one the engines are told to
connect to; every interface only when ``bind_host`` asks for it) and serves a
``HashStore``; clients (:class:`RendezvousStore`, a ``torch.distributed.Store``
the process group takes as it would a ``TCPStore``) must prove that they hold
the group's secret before the server reads a request, and the server proves
it holds it too:

    server -> client   nonce_s (32 bytes)
    client -> server   nonce_c (32 bytes), HMAC-SHA256(secret, "client" | nonce_s | nonce_c)
    server -> client   HMAC-SHA256(secret, "server" | nonce_c | nonce_s)

A connection that fails the check is closed before anything is read from it,
so a stranger writes nothing. The secret is fresh for every group (32 random
bytes); it reaches the engines in the group info of their weight update, a
request only holders of the run's engine key can make (megarl/rollout/engine_key.py),
the sender process through its pipe and vLLM's workers through vLLM's RPC, never on a
command line or in a log line.

The server also carries the publish's abort mark (:meth:`RendezvousServer.abort`):
engines still receiving poll it and leave the broadcast (megarl/rollout/receiver_group.py).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from megarl.errors import EngineError
from megarl.rollout.engine_key import is_loopback

log = logging.getLogger("megarl.rollout.publish")
#: what the rendezvous is called in its errors by default
WEIGHT_SYNC = "weight broadcast rendezvous"
#: the trainer world's (megarl/trainer/world_store.py)
WORLD_STORE = "trainer world store"
#: what a client that cannot connect is told to check, by label
_UNREACHABLE = {WEIGHT_SYNC: "it listens on the trainer's address for this host name unless "
                             "placement.weight_sync_bind says otherwise",
                WORLD_STORE: "trainer rank 0 serves it on the address its node reaches MASTER_ADDR from; the nodes "
                             "must reach each other on every TCP port"}
#: why a server closes a handshake, by label (a client's error and the server's warning)
_OTHER_SECRET = {WEIGHT_SYNC: "the connecting process holds another group's secret (another run's, or another "
                              "publish's)",
                 WORLD_STORE: "MEGARL_WORLD_KEY differs between the nodes: export the same value on every node "
                              "before `megarl launch` (a launch makes its own key when none is set)"}

#: the key whose presence says the publish is over for everyone still receiving
ABORT_KEY = "megarl/abort"
_NONCE = 32
_MAX_FRAME = 64 << 20


def new_secret() -> str:
    return os.urandom(32).hex()


def _mac(secret: str, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), label + a + b, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("rendezvous connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send_frame(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise ConnectionError(f"rendezvous frame of {n} bytes refused")
    return json.loads(_recv_exact(sock, n))


def _b64(value: bytes) -> str:
    return base64.b64encode(bytes(value)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _addr(host: str, port: int) -> tuple:
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return family, sockaddr


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connection to the rendezvous, retried while refused (it may start after the engines) up to ``timeout_s``."""
    family, sockaddr = _addr(host, port)
    deadline, pause = time.monotonic() + timeout_s, 0.05
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(min(timeout_s, 30.0))
        try:
            sock.connect(sockaddr)
            return sock
        except ConnectionRefusedError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)


class RendezvousServer:
    """The authenticated store of one broadcast group, served from a thread of this process.

    Listens on ``bind_host`` (default: ``host``, the address the ranks connect to) at ``port``
    (0: a free one, :attr:`port` says which).
    """

    def __init__(self, host: str, port: int, secret: str, *, bind_host: str | None = None,
                 timeout_s: float = 300.0, label: str = WEIGHT_SYNC) -> None:
        self.secret, self.label = secret, label
        #: addresses told about a refused handshake (once each: a stranger may try again and again)
        self._warned: set[str] = set()
        self.store = dist.HashStore()
        self.store.set_timeout(timedelta(seconds=timeout_s))
        family, sockaddr = _addr(bind_host or host, port)
        if not bind_host and not is_loopback(host) and is_loopback(sockaddr[0]) and label == WEIGHT_SYNC:
            log.warning("the weight broadcast host %r resolves to %s on this node, a loopback address engines on "
                        "other nodes cannot reach; if they run elsewhere, set placement.weight_sync_bind to this "
                        "node's cluster address (or 0.0.0.0 for every interface)", host, sockaddr[0])
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(sockaddr)
        except OSError as e:
            self._sock.close()
            raise EngineError(f"{label} cannot listen on {sockaddr[0]}:{port} ({e}); free the port or pick "
                              "another (placement.weight_sync_port)") from e
        self._sock.listen(64)
        self.address = self._sock.getsockname()[0]
        self.port = self._sock.getsockname()[1]
        #: connections closed before they passed the secret check (nothing was read from them)
        self.n_refused = 0
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="megarl-rendezvous", daemon=True).start()

    def abort(self, reason: str) -> None:
        """Tell every rank still receiving that this publish is over."""
        self.store.set(ABORT_KEY, reason.encode())

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        finally:
            with self._lock:
                conns, self._conns = list(self._conns), set()
            for conn in conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="megarl-rendezvous-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        member = False
        try:
            conn.settimeout(10.0)  # the handshake; a stranger holding a connection open gets nothing either
            nonce_s = os.urandom(_NONCE)
            conn.sendall(nonce_s)
            answer = _recv_exact(conn, _NONCE + 32)
            nonce_c, proof = answer[:_NONCE], answer[_NONCE:]
            if not hmac.compare_digest(proof, _mac(self.secret, b"client", nonce_s, nonce_c)):
                self._warn_refused(conn)
                return
            member = True
            conn.sendall(_mac(self.secret, b"server", nonce_c, nonce_s))
            conn.settimeout(None)
            while True:
                _send_frame(conn, self._handle(_recv_frame(conn)))
        except (OSError, ConnectionError, ValueError):
            return
        finally:
            if not member:
                self.n_refused += 1
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _warn_refused(self, conn: socket.socket) -> None:
        try:
            peer = conn.getpeername()[0]
        except OSError:
            return
        if peer not in self._warned:
            self._warned.add(peer)
            log.warning("%s: refused a connection from %s that did not prove the secret; if it is a process of this "
                        "run, %s", self.label, peer, _OTHER_SECRET.get(self.label, _OTHER_SECRET[WEIGHT_SYNC]))

    def _handle(self, req: dict) -> dict:
        op, s = req.get("op"), self.store
        try:
            if op == "set":
                s.set(req["key"], _unb64(req["value"]))
                return {"ok": None}
            if op == "get":
                return {"ok": _b64(s.get(req["key"]))}
            if op == "add":
                return {"ok": s.add(req["key"], int(req["amount"]))}
            if op == "check":
                return {"ok": s.check(list(req["keys"]))}
            if op == "wait":
                s.wait(list(req["keys"]), timedelta(seconds=float(req["timeout_s"])))
                return {"ok": None}
            if op == "delete_key":
                return {"ok": s.delete_key(req["key"])}
            if op == "num_keys":
                return {"ok": s.num_keys()}
            if op == "compare_set":
                return {"ok": _b64(s.compare_set(req["key"], _unb64(req["expected"]), _unb64(req["desired"])))}
            return {"error": f"unknown rendezvous operation {op!r}"}
        except Exception as e:  # noqa: BLE001 - a timed-out wait, a missing key: the client raises it
            return {"error": f"{type(e).__name__}: {e}"}


class RendezvousStore(dist.Store):
    """A client of a :class:`RendezvousServer`: the store a broadcast group's ranks rendezvous on."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float = 300.0,
                 label: str = WEIGHT_SYNC) -> None:
        super().__init__()
        self.host, self.port, self._timeout_s, self.label = host, port, timeout_s, label
        self._secret = secret
        self._clones: list[RendezvousStore] = []
        self._lock = threading.Lock()
        try:
            sock = _connect(host, port, timeout_s)
        except OSError as e:
            raise EngineError(f"{label} {host}:{port} unreachable ({type(e).__name__}: {e}); "
                              f"{_UNREACHABLE.get(label, _UNREACHABLE[WEIGHT_SYNC])}") from e
        try:
            nonce_s = _recv_exact(sock, _NONCE)
            nonce_c = os.urandom(_NONCE)
            sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
            proof = _recv_exact(sock, 32)
        except (OSError, ConnectionError) as e:
            sock.close()
            raise EngineError(f"{label} {host}:{port} refused this process's secret: it closed the handshake "
                              f"({type(e).__name__}: {e}); {_OTHER_SECRET.get(label, _OTHER_SECRET[WEIGHT_SYNC])}"
                              ) from e
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
            sock.close()
            raise EngineError(f"{host}:{port} is not this group's {label} (it does not hold "
                              "the group's secret)")
        sock.settimeout(None)
        self._sock = sock

    def _call(self, limit_s: float | None = None, **req):
        with self._lock:
            self._sock.settimeout(None if limit_s is None else limit_s + 30.0)
            try:
                _send_frame(self._sock, req)
                reply = _recv_frame(self._sock)
            except (OSError, ConnectionError) as e:
                raise EngineError(f"{self.label} {self.host}:{self.port} lost "
                                  f"({type(e).__name__}: {e})") from e
        if "error" in reply:
            raise EngineError(f"{self.label}: {reply['error']}")
        return reply["ok"]

    # torch.distributed.Store's interface, as the process groups use it
    def set(self, key, value) -> None:
        self._call(op="set", key=key, value=_b64(value.encode() if isinstance(value, str) else value))

    def get(self, key) -> bytes:
        return _unb64(self._call(self._timeout_s, op="get", key=key))

    def add(self, key, amount) -> int:
        return int(self._call(op="add", key=key, amount=int(amount)))

    def check(self, keys) -> bool:
        return bool(self._call(10.0, op="check", keys=list(keys)))

    def wait(self, keys, timeout=None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call(seconds, op="wait", keys=list(keys), timeout_s=seconds)

    def delete_key(self, key) -> bool:
        return bool(self._call(op="delete_key", key=key))

    def num_keys(self) -> int:
        return int(self._call(op="num_keys"))

    def compare_set(self, key, expected, desired) -> bytes:
        enc = [v.encode() if isinstance(v, str) else v for v in (expected, desired)]
        return _unb64(self._call(op="compare_set", key=key, expected=_b64(enc[0]), desired=_b64(enc[1])))

    def clone(self) -> "RendezvousStore":
        """Another client of the same server on a connection of its own (process groups take one each). Kept
        here too: torch holds only the C++ side, and its calls need the Python object alive."""
        twin = RendezvousStore(self.host, self.port, self._secret, self._timeout_s, self.label)
        self._clones.append(twin)
        return twin

    def aborted(self) -> str | None:
        """The abort mark's reason, or None while the publish goes on (raises once the server is gone)."""
        if not self.check([ABORT_KEY]):
            return None
        return self.get(ABORT_KEY).decode(errors="replace")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
