"""What every route of the agent endpoint shares: an episode's session, its key, reading a request body, and
OpenAI-shaped errors.

The chat completions (http_server.py) and the agent-service routes
(http_service.py) both look sessions up by key, read bodies under the same
limits and answer errors alike, so these pieces live below both of them. A
body is read within the session's ``timeout_s`` (agent.timeout_s; 408 past
it, so a key holder that sends part of a body cannot hold its session open)
and at most :data:`MAX_BODY_BYTES` (413).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megarl.agents.client import AgentClient
from megarl.config.agent import AgentConfig


@dataclass
class Session:
    """One episode's key and client; ``error`` is why the episode failed (None while it has not)."""

    key: str
    client: AgentClient
    #: agent.timeout_s: how long a body may take to arrive, and how long closing waits for a completion
    timeout_s: float = AgentConfig.timeout_s
    error: str | None = None
    busy: bool = False
    row: dict | None = None  # what a long-lived agent service is handed with the key (http_service.py)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


def error_response(status: int, message: str, type_: str, code: str) -> web.Response:
    """An OpenAI-shaped error that the openai package does not retry."""
    return web.json_response({"error": {"message": message, "type": type_, "code": code, "param": None}},
                             status=status, headers={"x-should-retry": "false"})


#: the largest request body the endpoint reads (413 past it)
MAX_BODY_BYTES = 64 << 20


async def read_json(request: web.Request, timeout_s: float) -> Any:
    """The request's JSON body, or the error response refusing it: 408 when it has not arrived within
    ``timeout_s``, 413 past :data:`MAX_BODY_BYTES`, 400 when it is not JSON. An empty body is ``None``."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        return error_response(408, f"the request body did not arrive within agent.timeout_s={timeout_s:g}s",
                              "invalid_request_error", "request_timeout")
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB, the most the "
                                   f"agent endpoint reads", "invalid_request_error", "request_too_large")
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as e:  # also bytes that are not UTF-8
        return error_response(400, f"the request body is not JSON: {e}", "invalid_request_error", "invalid_json")


def bearer(request: web.Request) -> str:
    """The request's ``Authorization: Bearer`` key ('' when it has none)."""
    auth = request.headers.get("Authorization", "")
    return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
