"""What every route of the agent endpoint shares: an episode's session, its key, and OpenAI-shaped errors.

The chat completions (http_server.py) and the agent-service routes
(http_service.py) both look sessions up by key and answer errors alike, so
these pieces live below both of them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from megarl.agents.client import AgentClient


@dataclass
class Session:
    """One episode's key and client; ``error`` is why the episode failed (None while it has not)."""

    key: str
    client: AgentClient
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


def bearer(request: web.Request) -> str:
    """The request's ``Authorization: Bearer`` key ('' when it has none)."""
    auth = request.headers.get("Authorization", "")
    return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
