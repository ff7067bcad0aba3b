"""The run's engine key: every request to a run's engine carries it as a bearer token.

An engine answers only callers that send ``Authorization: Bearer <key>``; any
other request, on any endpoint, gets 401 and changes nothing (anyone who
reaches the port could otherwise generate, abort or load weights from any
path). The key comes from ``MEGARL_ENGINE_KEY`` (or a pipe or file it names),
never from a command line (which other users of a host can read); each
process takes it once and removes it from its environment (megarl/isolation/secret_env.py):

* engines the trainer starts itself (:func:`megarl.rollout.client.launch_engine_process`)
  get a fresh key per run, or the trainer's, through a pipe;
* engines with commands of their own (``megarl launch``) and the trainer inherit
  the launching environment's; ``megarl launch`` makes one when it is not set
  and every process is started from the launching host (megarl/launch/engine_key_env.py).

An engine without a key serves only on a loopback address (``megarl engine``
on one machine); on any other address it refuses to start.
"""
from __future__ import annotations

import hmac
import ipaddress
import secrets
from typing import Any, Mapping

from aiohttp import web

from megarl.errors import ConfigError
from megarl.isolation.secret_env import ENGINE_KEY_ENV, take_secret


def engine_key_from_env(env: Mapping[str, str] | None = None) -> str:
    """The key in ``env``; "" when none is set. Without ``env``: this process's key, taken from its environment
    (or the pipe or file it names) once and then held in memory only (megarl/isolation/secret_env.py)."""
    return take_secret(ENGINE_KEY_ENV) if env is None else env.get(ENGINE_KEY_ENV, "")


def new_engine_key() -> str:
    return secrets.token_hex(24)


def auth_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it resolves to an address other hosts may reach
        return False


def check_serving_key(key: str, host: str) -> None:
    """An engine on ``host`` without a key: only on a loopback address."""
    if not key and not is_loopback(host):
        raise ConfigError(f"{ENGINE_KEY_ENV} is not set: an engine serving on {host} would take requests from "
                          f"anyone who reaches it. Export a secret for the engine and its trainer (e.g. "
                          f"`export {ENGINE_KEY_ENV}=$(openssl rand -hex 24)`), or serve on 127.0.0.1")


def key_middleware(key: str) -> Any:
    """aiohttp middleware: 401 for a request without ``Authorization: Bearer <key>``."""
    want = f"Bearer {key}".encode()

    @web.middleware
    async def require_key(request: web.Request, handler) -> web.StreamResponse:
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), want):
            return web.json_response({"error": f"{request.path}: missing or wrong engine key (the run's "
                                               f"{ENGINE_KEY_ENV}, sent as a bearer token)", "type": "EngineError"},
                                     status=401)
        return await handler(request)

    return require_key
