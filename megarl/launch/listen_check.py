"""Listeners other nodes must reach, checked before anything starts: none may listen on a loopback address.

Trainer rank 0 serves two things the other nodes connect to, both on the address its node reaches
``MASTER_ADDR`` from, the address it also announces: the trainer world's store (megarl/trainer/world_store.py;
the other trainer nodes) and the weight broadcast's rendezvous (megarl/rollout/rendezvous.py; engines with
commands of their own on other nodes). When the node's own name resolves to a loopback address there (Ubuntu
images map it to 127.0.1.1 in /etc/hosts), both would listen where no other node reaches them: the other ranks
would retry their connection until the store's timeout, the engines would fail at the first publish. So
`megarl launch` refuses such a plan on that node with one error naming the key to set, before any process
starts, and a trainer started some other way refuses it too (:func:`check_world_address`).

Engines and the dedicated scorer announce their node's name too; where it resolves to loopback on their own
node they listen on every interface instead (megarl/commands/train.py, ``engine_host``), still answering only
holders of the run's key, so they need no setting.
"""
from __future__ import annotations

import socket

from megarl.errors import ConfigError
from megarl.rollout.engine_key import is_loopback


def _short(host: str) -> str:
    return host.split(".")[0]


def route_address(peer: str, port: int = 9) -> str:
    """This node's address toward ``peer``, the one the route to it leaves from (a UDP connect picks the route
    and sends nothing); OSError when ``peer`` does not resolve or route."""
    family, _, _, _, sockaddr = socket.getaddrinfo(peer, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _route_address(peer: str) -> str:
    """:func:`route_address`, '' where it is loopback or ``peer`` does not resolve or route."""
    try:
        addr = route_address(peer)
    except OSError:
        return ""
    return "" if is_loopback(addr) else addr


def _fix(keys: str, name: str, peer: str) -> str:
    addr = _route_address(peer) if peer else ""
    example = addr or "<this node's cluster address>"
    return (f"{name!r} resolves to a loopback address on this node (an /etc/hosts line such as '127.0.1.1 {name}'), "
            f"which the other nodes cannot reach; set {keys.format(addr=example)}, or map {name} to the cluster "
            f"address in /etc/hosts")


def loopback_listener_problem(plan, weight_sync_bind: str = "", hostname: str | None = None) -> str | None:
    """The error for a plan whose trainer rank 0 would listen on loopback for other nodes (module doc), or None.

    Checked only on the node ``plan.master_addr`` names (``hostname``, default this one): how a name resolves
    is a node's own /etc/hosts."""
    name = plan.master_addr
    here = _short(hostname or socket.gethostname())
    if is_loopback(name) or _short(name) != here:
        return None
    master_host = _short(plan.trainer.hosts[0])
    trainer_nodes = len(plan.trainer.hosts) > 1
    remote_engines = [s.host for s in plan.engines if not s.spawned and _short(s.host) != master_host]
    broadcast_elsewhere = plan.weight_sync == "broadcast" and bool(remote_engines) and not weight_sync_bind
    if not trainer_nodes and not broadcast_elsewhere:
        return None
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None  # torchrun names an unresolvable MASTER_ADDR itself
    if not is_loopback(addr):
        return None
    if trainer_nodes:
        return _fix("placement.master_addr={addr} (the trainer world's store and the weight broadcast listen "
                    "there)", name, plan.trainer.hosts[1])
    return _fix("placement.weight_sync_bind={addr} (where the weight broadcast's rendezvous listens; or "
                "placement.master_addr)", name, remote_engines[0])


def check_world_address(address: str, master_addr: str, world_size: int, local_world_size: int) -> None:
    """Trainer rank 0's store address ``address`` (the one it reaches ``master_addr`` from): a loopback one is
    refused when the world spans several nodes (module doc)."""
    if is_loopback(address) and local_world_size < world_size:
        raise ConfigError(f"the trainer world spans {world_size // max(1, local_world_size)} nodes, but MASTER_ADDR "
                          f"{master_addr!r} is a loopback address ({address}) on trainer rank 0's node, which the "
                          f"other nodes cannot reach; set placement.master_addr to its cluster address, or map "
                          f"the name to that address in /etc/hosts")
