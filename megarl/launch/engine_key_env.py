"""The secrets of a launched plan: the engine key (megarl/rollout/engine_key.py) and the dedicated scorer's link key.

Neither is ever put on a command line (``ps`` shows command lines to every
user of a node), derived from the plan or printed, nor put in an environment
(``/proc/<pid>/environ`` shows a process's for its whole life). Engines with
commands of their own and the trainer read ``MEGARL_ENGINE_KEY``, a dedicated
scorer with its own command and the trainer ``MEGARL_DEDICATED_AUTHKEY``.
:func:`ensure_run_keys` returns the run's keys in memory: those the launching
shell exported (taken, so `megarl launch` itself no longer shows them) and,
where the launching environment has none, a fresh random secret
(``secrets.token_hex``), and always a fresh stop key, which signs the stop marker
trainer rank 0 writes for this launcher (megarl/stop_protocol.py), and a world
key, which every trainer rank proves to join the trainer world's store
(megarl/trainer/world_store.py). megarl/isolation/key_files.py hands them to each command
in a file of its own. torchrun across several nodes is the exception: each
node runs its own ``megarl launch``, so the key must be exported on every
node by hand (each launch takes it from its environment at once).
"""
from __future__ import annotations

import secrets
from typing import MutableMapping

from megarl.errors import ConfigError
from megarl.isolation.secret_env import (
    DEDICATED_AUTHKEY_ENV,
    ENGINE_KEY_ENV,
    SECRET_ENV_VARS,
    STOP_KEY_ENV,
    WORLD_KEY_ENV,
    take_secret,
)
from megarl.rollout.engine_key import engine_key_from_env, new_engine_key


def has_own_engines(plan) -> bool:
    """Engines started by commands of their own (the others are the trainer's children, with a key of its own)."""
    return any(not e.spawned for e in plan.engines)


def has_own_dedicated(plan) -> bool:
    """A dedicated scorer started by a command of its own (a spawned one talks to the trainer over queues)."""
    return plan.dedicated is not None and not plan.dedicated.spawned


def _ensure(name: str, make, plan, launcher: str, env: MutableMapping[str, str]) -> None:
    if env.get(name):
        return
    if launcher == "torchrun" and plan.allocation.source != "local":
        raise ConfigError(f"{name} is not set: with torchrun every node runs its own `megarl launch`, and the "
                          f"processes of every node must share one key. Export the same secret on every node, e.g. "
                          f"`export {name}=$(openssl rand -hex 24)` once, then copy it")
    env[name] = make()


def ensure_run_keys(plan, launcher: str, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The run's keys: fresh ones put in ``env`` for the plan's processes that need them (the engine key when
    engines have commands of their own, the link key when the dedicated scorer has one). ``env`` None: a dict
    in memory that starts with the keys this process was given (taken from its environment, which keeps none),
    and a fresh stop key and world key when it has none (module doc)."""
    in_memory = env is None
    if env is None:
        env = {name: value for name in SECRET_ENV_VARS if (value := take_secret(name))}
    if has_own_engines(plan) and not engine_key_from_env(env):
        _ensure(ENGINE_KEY_ENV, new_engine_key, plan, launcher, env)
    if has_own_dedicated(plan):
        _ensure(DEDICATED_AUTHKEY_ENV, lambda: secrets.token_hex(16), plan, launcher, env)
    if in_memory and not env.get(STOP_KEY_ENV):  # per launch: each node's launcher checks the marker with its own
        env[STOP_KEY_ENV] = secrets.token_hex(16)
    if in_memory:  # every trainer rank's, so with torchrun on several nodes exported by hand on each
        _ensure(WORLD_KEY_ENV, lambda: secrets.token_hex(16), plan, launcher, env)
    return dict(env)
