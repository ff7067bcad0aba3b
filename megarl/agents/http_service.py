"""Episodes for long-lived agent services (``agent.serve``): the service claims them over HTTP instead of megarl
running ``agent.command`` per episode.

Every prompt is rolled out ``rollout.group_size`` times (a group). A service
either asks megarl for work or brings its own rows
(``agent.rows_from_service``, megarl/agents/service_rows.py):

- ``POST /sessions`` (``Authorization: Bearer $MEGARL_AGENT_SERVICE_KEY``)
  with an empty body waits up to :data:`CLAIM_WAIT_S` for the next episode and
  answers ``{"key", "row", "group_id", "base_url"}`` (204 when none came); the
  service then talks to ``base_url`` with ``key`` as its OpenAI API key, as a
  command would;
- ``POST /sessions`` with ``{"row": {...}}`` (``agent.rows_from_service=true``)
  rolls the row out as one group and answers ``{"group_id", "sessions":
  [{"key", "base_url"}, ...]}``, one session per episode of the group, all of
  which the service runs and rewards; 400 for a bad row, 503 with
  ``Retry-After`` when the staleness gate held it back for ``agent.row_wait_s``;
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

from megarl.agents.http_session import Session, bearer, error_response, read_json
from megarl.errors import InputError

#: how long one POST /sessions waits for an episode before answering 204
CLAIM_WAIT_S = 20.0


class EpisodeOffers:
    """The episodes waiting for a service, and the two routes that hand them out and end them."""

    def __init__(self, server: Any, service_key: str) -> None:
        self.server = server
        self.service_key = service_key
        self._queue: asyncio.Queue[Session] | None = None
        self._outcomes: dict[str, asyncio.Future] = {}
        #: where posted rows go (agent.rows_from_service; megarl/agents/service_rows.py), None when megarl has data
        self.rows: Any = None

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
        if self.rows is None or not self.rows.take(session):  # not an episode of a row a request is waiting for
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
        body = await read_json(request, CLAIM_WAIT_S)
        if isinstance(body, web.Response):
            return body
        if isinstance(body, dict) and "row" in body:
            return await self._rollout_row(body["row"])
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
        return web.json_response({"key": session.key, "row": session.row,
                                  "group_id": session.client.traj.group_id, "base_url": self.server.base_url})

    async def _rollout_row(self, row: Any) -> web.Response:
        if self.rows is None:
            return error_response(400, "this run takes its prompts from data.path: POST /sessions with an empty body "
                                       "claims its episodes; set agent.rows_from_service=true to post rows",
                                  "invalid_request_error", "rows_not_taken")
        try:
            sessions = await self.rows.post(row)
        except InputError as e:
            return error_response(400, str(e), "invalid_request_error", "invalid_row")
        except RuntimeError as e:
            return error_response(500, str(e), "server_error", "group_failed")
        if sessions is None:
            wait = self.rows.wait_s
            return web.json_response(
                {"error": {"message": f"the staleness gate admitted no new group within agent.row_wait_s={wait:g}s "
                                      f"(training is behind generation); post the row again later",
                           "type": "server_error", "code": "busy", "param": None}},
                status=503, headers={"Retry-After": str(max(1, math.ceil(wait / 4)))})
        return web.json_response({"group_id": sessions[0].client.traj.group_id,
                                  "sessions": [{"key": s.key, "base_url": self.server.base_url} for s in sessions]})

    async def _report(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        session = self.server.lookup(key)
        if isinstance(session, web.Response):
            return session
        body = await read_json(request, session.timeout_s)
        if isinstance(body, web.Response):
            return body
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
