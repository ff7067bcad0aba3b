"""A remote engine that refuses the trainer's key (a key not shared between nodes) fails the trainer's connect at
once, naming MEGARL_ENGINE_KEY, instead of being retried as an engine still starting until the connect's timeout."""
import asyncio
import time

import pytest
from aiohttp import web

from megarl.rollout.client import EngineKeyRefused, connect_engine
from megarl.rollout.engine_key import key_middleware


def test_a_refused_key_ends_the_connect_at_once(monkeypatch):
    monkeypatch.setenv("MEGARL_ENGINE_KEY", "the-trainers-key")

    async def scenario():
        app = web.Application(middlewares=[key_middleware("the-engines-own-key")])
        async def health(request):
            return web.json_response({"ok": True})

        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            t0 = time.monotonic()
            with pytest.raises(EngineKeyRefused, match="HTTP 401.*same MEGARL_ENGINE_KEY"):
                await asyncio.wait_for(connect_engine(f"127.0.0.1:{port}", timeout_s=600), 20)
            return time.monotonic() - t0
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) < 10
