"""Listeners other nodes must reach, checked before anything starts: each binds the address it announces, and
none may listen on a loopback address for other nodes.

Trainer rank 0 serves two things the other nodes connect to, both on the address its node reaches
``MASTER_ADDR`` from, the address it also announces: the trainer world's store (megarl/trainer/world_store.py;
the other trainer nodes) and the weight broadcast's rendezvous (megarl/rollout/rendezvous.py; engines with
commands of their own on other nodes). Engines and the dedicated scorer with commands of their own listen on
their node's address in the plan, the one the controller (trainer rank 0) is told to connect to: the node's
name, resolved on the node, or the address ``placement.server_addresses`` gives it (megarl/launch/plan_parts.py).

When a node's own name resolves to a loopback address there (Ubuntu images map it to 127.0.1.1 in /etc/hosts),
such a listener would be where no other node reaches it: the other trainer ranks would retry their connection
until the store's timeout, the engines would fail at the first publish, the controller would find no engine. So
`megarl launch` refuses such a plan on that node with one error naming the key to set and the node's cluster
address as its value (the address its route to the peer leaves from), before any process starts
(:func:`loopback_listener_problem`: ``placement.master_addr`` or ``placement.weight_sync_bind`` on the trainer's
node, ``placement.server_addresses.<node>`` on a server's). A process started some other way refuses it too:
trainer rank 0 (:func:`check_world_address`), an engine or the dedicated scorer (:func:`server_listen_address`).
A loopback listener is fine where its only peer is on the same node: one node, or a server beside the controller.

An engine binding an address its node's name does not resolve to also points torch's gloo transport (the weight
broadcast's data plane) at that address's interface (:func:`gloo_interface_env`). And on a node of several
trainer nodes `megarl launch` refuses a ``placement.master_addr`` that is not trainer rank 0's node
(:func:`master_host_problem`): torchrun's node-rank 0 would serve the rendezvous where nobody looks for it.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct

from megarl.errors import ConfigError
from megarl.launch.cluster import short_host
from megarl.rollout.engine_key import is_loopback

log = logging.getLogger("megarl.listen_check")

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # linux/sockios.h


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


def _reached_over_loopback(peer: str) -> bool:
    try:
        return is_loopback(route_address(peer))
    except OSError:
        return False


def _fix(keys: str, name: str, peer: str) -> str:
    addr = _route_address(peer) if peer else ""
    example = addr or "<this node's cluster address>"
    return (f"{name!r} resolves to a loopback address on this node (an /etc/hosts line such as '127.0.1.1 {name}'), "
            f"which the other nodes cannot reach; set {keys.format(addr=example)}, or map {name} to the cluster "
            f"address in /etc/hosts")


def loopback_listener_problem(plan, weight_sync_bind: str = "", hostname: str | None = None) -> str | None:
    """The error for a plan with a listener on loopback for other nodes on this node (module doc), or None.

    Checked for the listeners of the node ``hostname`` (default this one): how a name resolves is a node's own
    /etc/hosts."""
    here = short_host(hostname or socket.gethostname())
    return _trainer_problem(plan, weight_sync_bind, here) or _servers_problem(plan, here)


def _servers_problem(plan, here: str) -> str | None:
    controller = plan.trainer.hosts[0]
    for s in plan.servers:
        if not s.spawned and short_host(s.host) == here:
            problem = _server_problem(s.listen_host, controller)
            if problem:
                return problem
    return None


def _server_problem(name: str, controller: str) -> str | None:
    """The error for a server listening on ``name`` here, where that is loopback though ``controller``'s node, which
    connects to it, is another one; None where it is fine (module doc)."""
    if is_loopback(name) or not controller or short_host(controller) == short_host(name):
        return None
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None  # the server names an unresolvable address itself
    if not is_loopback(addr) or _reached_over_loopback(controller):
        return None  # a controller this node reaches over loopback runs here
    return _fix(f"placement.server_addresses.{short_host(name)}={{addr}} (where the engines and the dedicated scorer "
                f"on {short_host(name)} listen and the trainer connects to them)", name, controller)


def server_listen_address(name: str, controller: str) -> str:
    """The address an engine or the dedicated scorer with its own command binds: ``name`` (its node's address in
    the plan, MEGARL_SERVER_HOST), resolved here. A ConfigError naming ``placement.server_addresses`` where that
    is loopback and ``controller`` (MEGARL_CONTROLLER_HOST), which connects to it, is another node (module doc);
    without a ``controller`` (a role started without it) a loopback address is bound with a warning. An address
    (placement.server_addresses) is bound as given."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(name))
    try:
        addr = socket.gethostbyname(name)
    except OSError as e:
        raise ConfigError(f"MEGARL_SERVER_HOST={name!r} does not resolve on this node ({e}); set "
                          f"placement.server_addresses.{short_host(name)} to the address the trainer reaches") from None
    problem = _server_problem(name, controller)
    if problem:
        raise ConfigError(problem)
    if is_loopback(addr) and not is_loopback(name) and not controller:
        log.warning("%s resolves to %s here, which other nodes cannot reach: set placement.server_addresses.%s "
                    "if the trainer runs on another node", name, addr, short_host(name))
    return addr


def gloo_interface_env(addr: str, hostname: str | None = None) -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": <the interface that holds addr>}`` for a server that binds ``addr`` on a node whose
    name resolves to a loopback address here: torch's gloo transport (the weight broadcast's data plane, in this
    process and in vLLM's workers) listens on the address the node's name resolves to otherwise, where the trainer
    does not reach it. {} where gloo's own choice is right, GLOO_SOCKET_IFNAME is set already, or no interface
    holds ``addr`` (IPv4 addresses only)."""
    if os.environ.get(GLOO_IFNAME_ENV) or is_loopback(addr):
        return {}
    try:
        own = socket.gethostbyname(hostname or socket.gethostname())
    except OSError:
        own = ""  # gloo falls back to loopback then too
    if own and not is_loopback(own):
        return {}
    name = _interface_of(addr)
    return {GLOO_IFNAME_ENV: name} if name else {}


def _interface_of(addr: str) -> str:
    """The network interface whose (first) IPv4 address is ``addr``; '' if none (Linux: SIOCGIFADDR)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
        if socket.inet_ntoa(packed[20:24]) == addr:
            return name
    return ""


def _trainer_problem(plan, weight_sync_bind: str, here: str) -> str | None:
    name = plan.master_addr
    if is_loopback(name) or short_host(name) != here:
        return None
    master_host = short_host(plan.trainer.hosts[0])
    trainer_nodes = len(plan.trainer.hosts) > 1
    remote_engines = [s.host for s in plan.engines if not s.spawned and short_host(s.host) != master_host]
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


def master_host_problem(plan, hostname: str | None = None) -> str | None:
    """The error for a plan of several trainer nodes whose ``master_addr`` is not the node torchrun's node-rank 0
    (trainer rank 0, whose store the others join) runs on, as seen from this node (``hostname``, default this
    one), or None: rank 0's node must hold that address (it can bind it), every other trainer node must not. Else
    the rendezvous waits for a store nobody serves until its timeout. An address that does not resolve here is
    left to torchrun."""
    hosts = [short_host(h) for h in plan.trainer.hosts]
    here = short_host(hostname or socket.gethostname())
    if len(hosts) < 2 or here not in hosts:
        return None
    mine = _holds(plan.master_addr)
    if mine is None or mine == (hosts[0] == here):
        return None
    rank0 = f"trainer rank 0 runs on the plan's first trainer node, {hosts[0]} (torchrun's --node-rank=0)"
    if mine:
        return (f"placement.master_addr={plan.master_addr} is an address of this node ({here}), but {rank0}, where "
                f"the trainer world's rendezvous is served; set placement.master_addr to an address of {hosts[0]}, "
                f"or leave it empty (the first trainer node's name)")
    return (f"placement.master_addr={plan.master_addr} is not an address of this node ({here}), and {rank0}: the "
            f"trainer world's rendezvous would be served here while the other nodes wait for it at "
            f"{plan.master_addr}; set placement.master_addr to an address of {here}, or leave it empty")


def _holds(name: str) -> bool | None:
    """Whether this node holds the address ``name`` resolves to here (it can bind it); None where it does not
    resolve."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0]
    except OSError:
        return None
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(sockaddr)
        except OSError:
            return False
    return True


def check_world_address(address: str, master_addr: str, world_size: int, local_world_size: int) -> None:
    """Trainer rank 0's store address ``address`` (the one it reaches ``master_addr`` from): a loopback one is
    refused when the world spans several nodes (module doc)."""
    if is_loopback(address) and local_world_size < world_size:
        raise ConfigError(f"the trainer world spans {world_size // max(1, local_world_size)} nodes, but MASTER_ADDR "
                          f"{master_addr!r} is a loopback address ({address}) on trainer rank 0's node, which the "
                          f"other nodes cannot reach; set placement.master_addr to its cluster address, or map "
                          f"the name to that address in /etc/hosts")
