"""The engine key of a launched plan (megarl/rollout/engine_key.py): in the environment, never on a command line.

Engines with commands of their own and the trainer read ``MEGARL_ENGINE_KEY``
from the environment they inherit. When the launching environment has none,
``megarl launch`` makes a fresh secret and puts it in its own environment
before starting the commands: the runner's subprocesses and srun
(``--export=ALL``, its default) inherit it, and mpirun forwards it
(``-x MEGARL_ENGINE_KEY``, megarl/launch/role_commands.py). torchrun across
several nodes is the exception: each node runs its own ``megarl launch``, so
the key must be exported on every node by hand.
"""
from __future__ import annotations

import os
from typing import MutableMapping

from megarl.errors import ConfigError
from megarl.rollout.engine_key import ENGINE_KEY_ENV, engine_key_from_env, new_engine_key


def has_own_engines(plan) -> bool:
    """Engines started by commands of their own (the others are the trainer's children, with a key of its own)."""
    return any(not e.spawned for e in plan.engines)


def ensure_engine_key(plan, launcher: str, env: MutableMapping[str, str] | None = None) -> None:
    """Put a fresh key in ``env`` (default: this process's environment) when the plan's engines need one."""
    env = os.environ if env is None else env
    if not has_own_engines(plan) or engine_key_from_env(env):
        return
    if launcher == "torchrun" and plan.allocation.source != "local":
        raise ConfigError(f"{ENGINE_KEY_ENV} is not set: with torchrun every node runs its own `megarl launch`, "
                          f"and the trainer and the engines must share one key. Export the same secret on every "
                          f"node, e.g. `export {ENGINE_KEY_ENV}=$(openssl rand -hex 24)` once, then copy it")
    env[ENGINE_KEY_ENV] = new_engine_key()
