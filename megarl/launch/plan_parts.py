"""The parts of a placement plan: the trainer's world and each server (an engine or the dedicated scorer).

A server with a command of its own listens on its node's name in the allocation, the one the controller connects
to, unless ``placement.server_addresses`` gives that node an address (:func:`with_server_addresses`): then it
binds that address and the controller connects there (megarl/launch/listen_check.py says when a node needs one).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.errors import ConfigError
from megarl.launch.cluster import short_host


@dataclass(frozen=True)
class TrainerPlan:
    """The trainer's torch.distributed world; the controller runs on its rank 0 (first host)."""

    hosts: tuple[str, ...]
    ranks_per_node: int
    world_size: int
    tp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int
    sequence_parallel: bool
    gpu_ids: tuple[int, ...]
    """Local GPU ids every trainer host gives its ranks (empty on cpu)."""


@dataclass(frozen=True)
class ServerPlan:
    """One engine or the dedicated scorer: a server process the controller talks to."""

    role: str
    """engine or dedicated."""
    index: int
    host: str
    tp: int
    gpu_ids: tuple[int, ...]
    port: int
    """HTTP port; 0 when the controller spawns it (it picks a free one)."""
    spawned: bool
    """True: started by the controller on its own node (cpu); False: started by its own command."""
    address: str = ""
    """Where it listens and the controller connects to it (placement.server_addresses); empty = ``host``."""

    @property
    def listen_host(self) -> str:
        """The address it binds and announces (MEGARL_SERVER_HOST): ``address``, else its node's name."""
        return self.address or self.host

    @property
    def addr(self) -> str:
        return f"{self.listen_host}:{self.port}"

    @property
    def name(self) -> str:
        return f"engine{self.index}" if self.role == "engine" else "dedicated"


def with_server_addresses(servers: list[ServerPlan], addresses: dict) -> list[ServerPlan]:
    """``servers`` with the address ``addresses`` (placement.server_addresses: a node's short name -> address)
    gives their node, for those with a command of their own; a name that is no such server's node is refused."""
    own = {short_host(s.host) for s in servers if not s.spawned}
    for name, addr in addresses.items():
        if not isinstance(addr, str) or not addr:
            raise ConfigError(f"placement.server_addresses.{name}={addr!r} must be an address (e.g. 10.0.0.3)")
        if short_host(str(name)) not in own:
            where = ", ".join(sorted(own)) or "no node: every server is spawned by the controller"
            raise ConfigError(f"placement.server_addresses names {name}, which runs no engine or dedicated scorer "
                              f"with a command of its own in this plan (those run on {where})")
    by_node = {short_host(str(k)): v for k, v in addresses.items()}
    return [s if s.spawned or short_host(s.host) not in by_node else replace(s, address=by_node[short_host(s.host)])
            for s in servers]
