"""What a process launched from a plan is: its role and the addresses it needs (the MEGARL_* variables).

:mod:`megarl.launch.role_commands` sets these variables in front of every role's
``python -m megarl.train``; the entry point reads them back with
:func:`current_role`. A process with none of them (plain ``megarl train``)
is the trainer that spawns its engines itself.

=========================  ==========================================================
MEGARL_ROLE                trainer, engine or dedicated
MEGARL_ENGINE_ADDRS        trainer: host:port of every engine started by its own command
MEGARL_DEDICATED_ADDR      trainer: host:port of the dedicated scorer started by its own command
MEGARL_ENGINE_INDEX        engine: its index in rollout.n_engines
MEGARL_DEDICATED_AUTHKEY   trainer / dedicated: the key of their TCP connection, taken at start
                           (megarl/isolation/secret_env.py)
MEGARL_SERVER_PORT         engine: the HTTP port to serve on; dedicated: the TCP port the trainer connects to
MEGARL_SERVER_HOST         engine / dedicated: its node's address in the plan, which it serves on
MEGARL_CONTROLLER_HOST     engine / dedicated: the node of the controller (trainer rank 0), which connects to it
MEGARL_ENGINE_KEY          trainer / engine: the key every engine request carries (megarl/rollout/engine_key.py)
MEGARL_SERVER_TP           engine / dedicated: its tensor-parallel size
MEGARL_WEIGHT_SYNC_ADDR    host:port of the trainer -> servers weight broadcast group (broadcast only)
MEGARL_WEIGHT_SYNC_WORLD   size of that group (trainer rank 0 + every engine GPU worker)
MEGARL_WEIGHT_SYNC_RANK    engine: rank of its first worker in that group
=========================  ==========================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from megarl.errors import ConfigError

ROLES = ("trainer", "engine", "dedicated")


@dataclass(frozen=True)
class RoleEnv:
    role: str = "trainer"
    engine_addrs: tuple[str, ...] = field(default=())
    dedicated_addr: str = ""
    engine_index: int = 0
    server_port: int = 0
    server_host: str = ""
    controller_host: str = ""
    server_tp: int = 1
    weight_sync_addr: str = ""
    weight_sync_world: int = 0
    weight_sync_rank: int = 0

    @property
    def launched(self) -> bool:
        """True when started from a plan (servers are remote), False for a plain `megarl train`."""
        return bool(self.engine_addrs or self.dedicated_addr or self.role != "trainer")


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer") from None


def current_role(env: Mapping[str, str] | None = None) -> RoleEnv:
    env = os.environ if env is None else env
    role = env.get("MEGARL_ROLE", "trainer") or "trainer"
    if role not in ROLES:
        raise ConfigError(f"MEGARL_ROLE={role!r} is not one of {', '.join(ROLES)}")
    addrs = tuple(a for a in env.get("MEGARL_ENGINE_ADDRS", "").split(",") if a)
    return RoleEnv(role=role, engine_addrs=addrs, dedicated_addr=env.get("MEGARL_DEDICATED_ADDR", ""),
                   engine_index=_int(env, "MEGARL_ENGINE_INDEX", 0), server_port=_int(env, "MEGARL_SERVER_PORT", 0),
                   server_host=env.get("MEGARL_SERVER_HOST", ""), controller_host=env.get("MEGARL_CONTROLLER_HOST", ""),
                   server_tp=_int(env, "MEGARL_SERVER_TP", 1), weight_sync_addr=env.get("MEGARL_WEIGHT_SYNC_ADDR", ""),
                   weight_sync_world=_int(env, "MEGARL_WEIGHT_SYNC_WORLD", 0),
                   weight_sync_rank=_int(env, "MEGARL_WEIGHT_SYNC_RANK", 0))
