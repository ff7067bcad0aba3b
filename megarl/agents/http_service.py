"""Episodes for long-lived agent services (``agent.serve``): the service claims them over HTTP instead of megarl
running ``agent.command`` per episode.

megarl owns the data and the groups (every prompt is rolled out
``rollout.group_size`` times), so a service asks for work rather than bringing
rows:

- ``POST /sessions`` (``Authorization: Bearer $MEGARL_AGENT_SERVICE_KEY``)
  waits up to :data:`CLAIM_WAIT_S` for the next episode and answers
  ``{"key", "row", "base_url"}`` (204 when none came); the service then talks
  to ``base_url`` with ``key`` as its OpenAI API key, as a command would;
- ``POST /sessions/{key}/reward`` with ``{"reward": r}`` or ``{"answer": "..."}``
  (scored by ``reward.fn``) ends the episode; the key is refused from then on.

An episode nobody claims and ends within ``agent.timeout_s`` fails (counted in
``n_agent_failed``), as a command that runs too long does.
"""
from __future__ import annotations

import asyncio
import hmac
import math
from typing import Any

from aiohttp import web

from megarl.agents.http_server import Session, bearer, error_response

#: how long one POST /sessions waits for an episode before answering 204
CLAIM_WAIT_S = 20.0


class EpisodeOffers:
    """The episodes waiting for a service, and the two routes that hand them out and end them."""

    def __init__(self, server: Any, service_key: str) -> None:
        self.server = server
        self.service_key = service_key
        self._queue: asyncio.Queue[Session] | None = None
        self._outcomes: dict[str, asyncio.Future] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/sessions", self._claim)
        app.router.add_post("/sessions/{key}/reward", self._report)

    def offer(self, session: Session, row: dict[str, Any]) -> asyncio.Future:
        """Put ``session`` up for a service; the future's result is ``(answer, reward)`` once it reports."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        session.row = row
        outcome = asyncio.get_running_loop().create_future()
        self._outcomes[session.key] = outcome
        self._queue.put_nowait(session)
        return outcome

    def withdraw(self, session: Session) -> None:
        self._outcomes.pop(session.key, None)  # a claim skips it from now on

    async def _claim(self, request: web.Request) -> web.Response:
        if not self.service_key:
            return error_response(404, "this run hands out no sessions: set agent.serve=true (and "
                                       "MEGARL_AGENT_SERVICE_KEY) for an agent service", "invalid_request_error",
                                  "not_found")
        if not hmac.compare_digest(bearer(request).encode(), self.service_key.encode()):
            return error_response(401, "POST /sessions needs 'Authorization: Bearer <the run's "
                                       "MEGARL_AGENT_SERVICE_KEY>'", "invalid_request_error", "invalid_api_key")
        if self._queue is None:
            self._queue = asyncio.Queue()
        try:
            async with asyncio.timeout(CLAIM_WAIT_S):
                while True:
                    session = await self._queue.get()
                    if session.key in self._outcomes:  # not withdrawn (timed out) meanwhile
                        break
        except TimeoutError:
            return web.Response(status=204)
        return web.json_response({"key": session.key, "row": session.row, "base_url": self.server.base_url})

    async def _report(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        session = self.server.lookup(key)
        if isinstance(session, web.Response):
            return session
        try:
            body = await request.json()
        except ValueError as e:
            return error_response(400, f"the request body is not JSON: {e}", "invalid_request_error", "invalid_json")
        outcome = self._outcomes.get(key)
        if outcome is None or outcome.done():  # checked after the last await: two reports cannot both pass
            return error_response(409, "this episode's outcome was reported already", "invalid_request_error",
                                  "already_reported")
        reward, answer = (body.get("reward"), body.get("answer")) if isinstance(body, dict) else (None, None)
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                return error_response(400, f"reward must be a finite number, got {reward!r}", "invalid_request_error",
                                      "invalid_reward")
            reward = float(reward)
        elif not isinstance(answer, str):
            return error_response(400, "send {'reward': <number>} or {'answer': <text for reward.fn>}",
                                  "invalid_request_error", "invalid_reward")
        outcome.set_result((answer if isinstance(answer, str) else "", reward))
        return web.json_response({"ok": True})
