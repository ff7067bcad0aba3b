"""The trainer world's store: only processes holding the run's world key can read or write it.

``init_process_group(init_method="env://")`` gives the ranks torch's TCPStore at ``MASTER_ADDR:MASTER_PORT``
(torchrun's own under torchrun), which takes any client: whoever reaches the port lists every key (the gloo
ranks' addresses, NCCL's ids) and writes one (points a rank elsewhere). With the world key
(``MEGARL_WORLD_KEY``, megarl/isolation/secret_env.py: `megarl launch` makes one per launch and hands it to every
trainer
rank in its key file) the ranks meet in megarl's authenticated store instead (megarl/rollout/rendezvous.py: a
client must prove the key before anything is read, and the server proves it too): rank 0 serves it on the
address it reaches ``MASTER_ADDR`` from (``placement.weight_sync_bind`` is not involved), and torch's store
carries only where it listens (``megarl/world_store``, not a secret: a stranger who rewrites it gets the ranks
to fail their handshake, nothing more). Without the key (a hand-started torchrun, the distributed tests) the
world is torch's, as before, with one warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta

import torch.distributed as dist

from megarl.isolation.secret_env import WORLD_KEY_ENV, take_secret
from megarl.launch.listen_check import check_world_address, route_address
from megarl.rollout.rendezvous import WORLD_STORE, RendezvousServer, RendezvousStore

log = logging.getLogger("megarl.trainer")
#: the key of torch's store that says where the authenticated one listens
ADDRESS_KEY = "megarl/world_store"
LABEL = WORLD_STORE
#: rank 0's server and every rank's client, alive as long as the process: torch holds only the C++ side of a
#: Python store, whose calls need the Python object
_alive: list[RendezvousServer | RendezvousStore] = []


def authenticated_store(rank: int, world_size: int, timeout_s: float = 1800.0) -> dist.Store | None:
    """The store this rank joins the world with (module doc); None without a world key."""
    secret = take_secret(WORLD_KEY_ENV)
    if not secret:
        log.warning("no %s: the trainer ranks meet in torch's store at %s:%s, which takes any client; start "
                    "them with `megarl launch`, which makes the key", WORLD_KEY_ENV,
                    os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        return None
    secret = hashlib.sha256(secret.encode()).hexdigest()  # any text a user exports; the handshake takes hex
    host = ""
    if rank == 0:  # refused before the rendezvous: a loopback store would keep the other nodes retrying
        master_addr = os.environ["MASTER_ADDR"]
        host = route_address(master_addr, int(os.environ["MASTER_PORT"]))  # where the other ranks reach rank 0
        check_world_address(host, master_addr, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    base, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                      timeout=timedelta(seconds=timeout_s)))
    if rank == 0:
        server = RendezvousServer(host, 0, secret, timeout_s=timeout_s, label=LABEL)
        _alive.append(server)
        base.set(ADDRESS_KEY, f"{server.address} {server.port}")
    host, port = base.get(ADDRESS_KEY).decode().split()
    store = RendezvousStore(host, int(port), secret, timeout_s=timeout_s, label=LABEL)
    _alive.append(store)
    return store
