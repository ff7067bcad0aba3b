"""What a launched server role runs (MEGARL_ROLE=engine or dedicated; megarl/launch/roles.py)."""
from __future__ import annotations

import asyncio

from megarl.errors import ConfigError


def serve_role(cfg, role) -> None:
    """A process launched for a server role of a plan."""
    if role.role == "engine":
        from megarl.rollout.base import engine_options
        from megarl.rollout.server import serve

        tp = {"tensor_parallel_size": role.server_tp} if role.server_tp > 1 else {}
        if tp and cfg.rollout.backend != "vllm":
            raise ConfigError(f"placement.engine_tp={role.server_tp} needs rollout.backend=vllm "
                              f"(the hf engine runs one worker); set placement.engine_tp=1")
        resources = engine_options(cfg.rollout.backend, cfg.rollout.kv_cache_gb, cfg.rollout.cpu_threads)
        asyncio.run(serve(cfg.model.checkpoint, cfg.rollout.backend, host="0.0.0.0", port=role.server_port,
                          dtype=cfg.model.dtype, **resources, **tp))
        return
    from recovery.dedicated import serve_role as serve_dedicated  # the old-logit scorer on its own node(s)

    serve_dedicated(cfg, role.server_port)
