"""HTTP API around one engine (`megarl engine`), the process boundary between controller and engines.

    POST /generate        GenerateRequest.to_dict()        -> GenerateResult.to_dict()
    POST /abort_all       {}                               -> {"ok": true}
    POST /update_weights  {"version", "path"}              -> {"ok": true, "version", "seconds", "phases"}
                          {"version", "group_info", "names_shapes_dtypes"}
    POST /pause, /resume  {}                               -> {"ok": true}
    GET  /version                                          -> {"version"}
    GET  /health                                           -> engine.health()

With ``parent_pid`` (``megarl engine --parent-pid``, set by ``launch_engine_process``)
the server shuts down when that process dies, even by SIGKILL: the engine runs
in its own session, so nothing else would stop it. A watchdog thread polls
``os.getppid()``; after an orderly shutdown has had 15 s, it kills the
engine's whole process group (vLLM's engine-core included).

Every endpoint needs the run's key (megarl/rollout/engine_key.py): without
it, 401 and nothing changes.

Errors come back as ``{"error": message, "type": "InputError" | "EngineError" | ...}``
(400 for bad input, 500 otherwise); :class:`megarl.rollout.client.EngineClient`
raises the same exception class on its side.
"""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import sys
import threading
import time

from aiohttp import web

from megarl.errors import EngineError, InputError, MegarlError
from megarl.rollout.backends import make_engine
from megarl.rollout.base import resources_note
from megarl.rollout.engine_key import check_serving_key, engine_key_from_env, key_middleware
from megarl.types import GenerateRequest


def _error(e: Exception) -> web.Response:
    if isinstance(e, MegarlError):
        kind, status = type(e).__name__, 400 if isinstance(e, InputError) else 500
    else:
        kind, status = "EngineError", 500
    return web.json_response({"error": str(e) or type(e).__name__, "type": kind}, status=status)


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except Exception as e:
        raise InputError(f"{request.path}: body is not JSON ({e})") from e
    if not isinstance(body, dict):
        raise InputError(f"{request.path}: body must be a JSON object")
    return body


def build_app(engine, key: str = "") -> web.Application:
    """The aiohttp application serving ``engine`` (any :class:`~megarl.rollout.base.Engine`); with ``key``, every
    request must carry it (megarl/rollout/engine_key.py)."""

    async def generate(request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            try:
                req = GenerateRequest.from_dict(body)
            except (KeyError, TypeError) as e:
                raise InputError(f"/generate: malformed request ({type(e).__name__}: {e})") from e
            return web.json_response((await engine.generate(req)).to_dict())
        except Exception as e:
            return _error(e)

    async def update_weights(request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            if "version" not in body:
                raise InputError("/update_weights: 'version' is required")
            version = int(body["version"])
            t0 = time.perf_counter()
            if body.get("path"):
                phases = await engine.update_weights_from_disk(str(body["path"]), version)
            elif body.get("group_info"):
                phases = await engine.update_weights_from_broadcast(body["group_info"],
                                                                    body.get("names_shapes_dtypes", []), version)
            else:
                raise InputError("/update_weights: give 'path' (safetensors directory) or 'group_info' (broadcast)")
            return web.json_response({"ok": True, "version": version, "seconds": time.perf_counter() - t0,
                                      "phases": phases})
        except Exception as e:
            return _error(e)

    def simple(call):
        async def handler(request: web.Request) -> web.Response:
            try:
                await call()
                return web.json_response({"ok": True})
            except Exception as e:
                return _error(e)
        return handler

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": await engine.version()})

    async def health(request: web.Request) -> web.Response:
        try:
            return web.json_response(await engine.health())
        except Exception as e:
            return _error(e)

    app = web.Application(client_max_size=64 << 20, middlewares=[key_middleware(key)] if key else [])
    app.add_routes([web.post("/generate", generate), web.post("/update_weights", update_weights),
                    web.post("/abort_all", simple(engine.abort_all)), web.post("/pause", simple(engine.pause)),
                    web.post("/resume", simple(engine.resume)), web.get("/version", version),
                    web.get("/health", health)])
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the port before the (slow) model load, so a taken port fails fast and clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a live listener still conflicts
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EngineError(f"port {port} on {host} is already in use; pick another --port") from e
        raise EngineError(f"cannot bind {host}:{port}: {e}") from e
    return sock


class ParentWatch:
    """Ends this process when ``parent_pid`` is no longer its parent: ``stop()`` first, a group SIGKILL later."""

    def __init__(self, parent_pid: int, grace_s: float = 15.0, poll_s: float = 0.5) -> None:
        self.parent_pid = parent_pid
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.stop = None  # set once serving: a graceful shutdown
        threading.Thread(target=self._run, name="megarl-parent-watch", daemon=True).start()

    def _run(self) -> None:
        while os.getppid() == self.parent_pid:
            time.sleep(self.poll_s)
        print(f"megarl engine: parent process {self.parent_pid} is gone; shutting down", file=sys.stderr, flush=True)
        if self.stop is not None:
            self.stop()
            time.sleep(self.grace_s)
        if os.getpgrp() == os.getpid():  # leader of its own group (launch_engine_process): take the children too
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)


async def serve(checkpoint: str, backend: str, host: str = "127.0.0.1", port: int = 8000,
                parent_pid: int | None = None, **options) -> None:
    """Load the engine, serve HTTP until SIGINT/SIGTERM (or ``parent_pid`` dies), then shut the engine down.

    Requests must carry the key in ``MEGARL_ENGINE_KEY``; without one, only a loopback ``host`` is served.
    """
    key = engine_key_from_env()
    check_serving_key(key, host)
    watch = ParentWatch(parent_pid) if parent_pid else None
    sock = bind_socket(host, port)
    t0 = time.perf_counter()
    try:
        engine = await make_engine(backend, checkpoint, **options)
    except BaseException:
        sock.close()
        raise
    runner = web.AppRunner(build_app(engine, key), access_log=None)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        health = await engine.health()
        resources = resources_note(health)  # the KV cache and threads it was given
        print(f"megarl engine ({backend}, {health.get('dtype', '?')}) serving {checkpoint} on "
              f"http://{host}:{port} (started in {time.perf_counter() - t0:.1f} s{resources})", file=sys.stderr,
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if watch is not None:
            watch.stop = lambda: loop.call_soon_threadsafe(stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        await engine.close()
