"""An OpenAI-compatible HTTP endpoint on the controller's event loop, for agents running in other processes.

``POST /v1/chat/completions`` and ``GET /v1/models``; each episode is a session
whose API key (``Authorization: Bearer <key>``) names it and is its only
authorization. A completion is a thin translation onto the episode's
:class:`megarl.agents.client.AgentClient` (``client.chat.completions.create``),
so an agent over HTTP is recorded exactly as an in-process one: the engine's
ids, template tokens with mask 0, per-token versions, interrupts invisible,
a re-rendered past as a new trajectory of the episode.

Errors are OpenAI-shaped (``{"error": {"message", "type", "code"}}``) and carry
``x-should-retry: false`` (the openai package would otherwise resend a
completion the engine may already be generating): 401 for a missing, unknown
or finished key, 409 for a second completion while one of the same session is
running, 400 for malformed input, 404 for a model other than the one served
where ``agent.strict_model_name`` asks for it (any name is served otherwise;
a response's ``model`` names the run's model, which served it), 408 for a
body that has not arrived within the session's ``agent.timeout_s``, 413 for
one over 64 MiB. A completion past ``agent.max_turns`` or the token
budget, or one that fails inside megarl, fails the episode
(:attr:`Session.error`); bad input does not, and uses no turn. The request
checks live in http_requests.py. ``stream: true`` sends the finished
completion as server-sent events (http_stream.py).

A key is ``megarl-<secret>`` and says nothing about other sessions; a finished
key is told it has finished (the endpoint remembers the last
:data:`FINISHED_KEYS_KEPT`), any other is unknown.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace

from aiohttp import web

from megarl.agents.client import AgentClient, AgentLimitError
from megarl.agents.http_requests import RequestError, completion_kwargs, stream_mode
from megarl.agents.http_service import EpisodeOffers
from megarl.agents.http_session import MAX_BODY_BYTES, Session, bearer, error_response, read_json
from megarl.agents.http_stream import send_streamed
from megarl.config.agent import AgentConfig
from megarl.errors import InputError

log = logging.getLogger("megarl.agents.http")

#: finished keys remembered, to tell their holders so (older ones are then simply unknown)
FINISHED_KEYS_KEPT = 1 << 16


@web.middleware
async def _openai_shaped(request: web.Request, handler):
    """Unknown paths and methods get an OpenAI-shaped error too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, f"{request.method} {request.path}: {e.reason}; megarl serves POST "
                                        f"/v1/chat/completions and GET /v1/models", "invalid_request_error",
                              "not_found" if e.status == 404 else "method_not_allowed")


class AgentHttpServer:
    """The endpoint: ``await start()``, then :meth:`open_session` per episode and :meth:`close_session` after it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model: str = "megarl", service_key: str = "",
                 strict_model_name: bool = False) -> None:
        self.host, self.port, self.model = host, port, model
        #: refuse a request naming a model other than ``model`` (agent.strict_model_name)
        self.strict_model_name = strict_model_name
        #: episodes waiting for a long-lived agent service (POST /sessions with ``service_key``)
        self.offers = EpisodeOffers(self, service_key)
        self._sessions: dict[str, Session] = {}
        self._finished: dict[str, None] = {}  # keys of closed sessions, oldest first
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """What an agent sets as OPENAI_BASE_URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_openai_shaped])
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self.offers.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise InputError(f"the agent endpoint cannot listen on {self.host}:{self.port} ({e}); choose another "
                             f"agent.http_port (0 = a free port) or agent.http_host") from None
        self.port = self._runner.addresses[0][1]
        log.info("agent endpoint at %s", self.base_url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, client: AgentClient, timeout_s: float = AgentConfig.timeout_s) -> Session:
        """A new episode's session; ``timeout_s`` (agent.timeout_s) bounds its body reads and its closing."""
        session = Session(f"megarl-{secrets.token_urlsafe(32)}", client, timeout_s=timeout_s)
        self._sessions[session.key] = session
        return session

    async def close_session(self, session: Session) -> None:
        """Refuse the key from now on; a completion still running finishes first (its tokens are the episode's),
        for at most the session's ``timeout_s``: past it the episode fails (:attr:`Session.error`)."""
        if self._sessions.pop(session.key, None) is not None:
            self._finished[session.key] = None
            while len(self._finished) > FINISHED_KEYS_KEPT:
                del self._finished[next(iter(self._finished))]
        try:
            await asyncio.wait_for(session.idle.wait(), session.timeout_s)
        except TimeoutError:
            session.error = session.error or (f"a completion was still running agent.timeout_s="
                                              f"{session.timeout_s:g}s after the episode ended")

    # -- handlers --------------------------------------------------------------------------------
    def _session(self, request: web.Request) -> Session | web.Response:
        return self.lookup(bearer(request))

    def lookup(self, key: str) -> Session | web.Response:
        """The live session of ``key``, or the 401 that refuses it."""
        if not key:
            return error_response(401, "no API key: send the episode's key as 'Authorization: Bearer <key>' "
                                       "(OPENAI_API_KEY)", "invalid_request_error", "missing_api_key")
        session = self._sessions.get(key)
        if session is not None:
            return session
        if key in self._finished:
            return error_response(401, "this API key's episode has finished; a new episode has a new key",
                                  "invalid_request_error", "session_finished")
        return error_response(401, "unknown API key: megarl hands each episode its own key (OPENAI_API_KEY)",
                              "invalid_request_error", "invalid_api_key")

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "megarl"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if isinstance(session, web.Response):
            return session
        if session.busy:
            return error_response(409, "a completion of this session is still running: an episode's completions "
                                       "are one conversation, send them one after another", "invalid_request_error",
                                  "concurrent_completion")
        session.busy = True  # before the first await: a second request arriving meanwhile gets 409
        session.idle.clear()
        client, limits = session.client, session.client.limits
        try:
            body = await read_json(request, session.timeout_s)
            if isinstance(body, web.Response):  # late, too large or not JSON
                return body
            try:
                kwargs, stop_ids = completion_kwargs(body, client.tokenizer, model=self.model,
                                                     max_tokens=limits.max_tokens,
                                                     strict_model_name=self.strict_model_name)
                stream, include_usage = stream_mode(body)
            except RequestError as e:
                return error_response(e.status, str(e), "invalid_request_error", e.code)
            if stop_ids:  # this request's stop tokens on top of the run's (one completion at a time per session)
                client.limits = replace(limits, sampling=replace(
                    limits.sampling, stop_token_ids=[*limits.sampling.stop_token_ids, *stop_ids]))
            resp = await client.chat.completions.create(**kwargs)
        except AgentLimitError as e:
            session.error = session.error or f"AgentLimitError: {e}"
            return error_response(400, str(e), "invalid_request_error", "agent_budget_exceeded")
        except Exception as e:
            if isinstance(e, (InputError, ValueError)) or type(e).__module__.startswith("jinja2"):
                # a conversation, setting or message the chat template refuses: the agent is told and goes on
                return error_response(400, str(e), "invalid_request_error", "invalid_request")
            # megarl failed: the episode fails, the run goes on
            log.exception("agent completion failed")
            session.error = session.error or f"{type(e).__name__}: {e}"
            return error_response(500, f"megarl failed to complete: {type(e).__name__}: {e}", "server_error",
                                  "internal_error")
        finally:
            client.limits = limits
            session.busy = False
            session.idle.set()
        client.stats.n_tool_calls += len(resp.choices[0].message.tool_calls or ())  # the agent runs them itself
        completion = {**resp.model_dump(mode="json"), "model": self.model}  # what served it, whatever was asked
        if stream:  # recorded above like any completion; only the delivery differs
            return await send_streamed(request, completion, include_usage)
        return web.json_response(completion)


class SharedServers:
    """One endpoint per event loop and fixed address, shared by the run's workflows (training and evaluation);
    port 0 gives every workflow an endpoint of its own."""

    def __init__(self) -> None:
        self._open: dict[tuple, list] = {}  # (loop, host, port) -> [server, users]

    async def acquire(self, host: str, port: int, model: str, service_key: str = "",
                      strict_model_name: bool = False) -> AgentHttpServer:
        key = (id(asyncio.get_running_loop()), host, port)
        if port and key in self._open:
            self._open[key][1] += 1
            return self._open[key][0]
        server = AgentHttpServer(host, port, model, service_key, strict_model_name)
        await server.start()
        if port:
            self._open[key] = [server, 1]
        return server

    async def release(self, server: AgentHttpServer, port: int) -> None:
        key = (id(asyncio.get_running_loop()), server.host, port)
        entry = self._open.get(key)
        if entry is not None and entry[0] is server:
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._open[key]
        await server.stop()


SHARED = SharedServers()
