"""/generate deadlines: a wedged engine (it answers /health, never /generate) is restarted and its requests
sent again; the automatic deadline from the engines' measured speed, by hand-computed numbers.

A real vLLM engine cannot be wedged on demand, so the wedge is an HTTP server
of this test's own (:class:`FakeWedgedEngineServer`, a fake for the wedge
only); megarl's real EngineClient talks to it over HTTP, and the supervisor
and the interruptible generation are megarl's own. The engine the restart
brings up is test_supervisor.py's in-process stand-in (the real launch path
is megarl.rollout.client.launch_engine_process, exercised by the e2e tests).
"""
import asyncio

import pytest
from aiohttp import web
from test_supervisor import FakeEngine

from megarl.config.schema import RolloutConfig
from megarl.errors import ConfigError
from megarl.rollout.client import EngineClient
from megarl.rollout.generate_deadline import AUTO_MIN_S, AUTO_UNMEASURED_S, DeadlineMissed, GenerateDeadlines
from megarl.rollout.interruptible import InterruptibleGeneration
from megarl.rollout.supervisor import EngineSupervisor
from megarl.types import GenerateResult, SamplingParams, Trajectory


class FakeWedgedEngineServer:
    """Answers /health (ok) and /abort_all like a live engine server; accepts /generate and never answers."""

    def __init__(self) -> None:
        self.n_generate = 0
        self.runner: web.AppRunner | None = None

    async def _health(self, request):
        return web.json_response({"ok": True, "version": 0, "n_workers": 1})

    async def _abort(self, request):
        return web.json_response({"ok": True})

    async def _generate(self, request):
        self.n_generate += 1
        await asyncio.Event().wait()  # wedged: the HTTP loop lives on, the request never finishes

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/abort_all", self._abort)
        app.router.add_post("/generate", self._generate)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()


def test_a_wedged_engine_is_restarted_and_its_requests_are_sent_again():
    async def main():
        wedge = FakeWedgedEngineServer()
        wedged = EngineClient(await wedge.start(), key="k")
        launched = []

        def launch(i):
            e = FakeEngine(2000 + len(launched))
            launched.append(e)
            return None, e

        sup = EngineSupervisor([(None, wedged)], launch=launch, weights=("/ckpt", 0), health_interval_s=0.05,
                               health_timeout_s=1.0, generate_timeout_s=0.5)
        await sup.start()
        gen = InterruptibleGeneration(sup, RolloutConfig(max_concurrency=8), seed=0,
                                      counters={"n_interrupted": 0, "n_engine_resubmits": 0,
                                                "n_engine_prefix_cached_tokens": 0})
        trajs = [Trajectory(traj_id=f"g0-{j}", group_id="g0", prompt_ids=[1, 5, 2]) for j in range(3)]
        try:
            results = await asyncio.wait_for(asyncio.gather(*(
                gen.generate(t, [1, 5, 2], SamplingParams(max_new_tokens=4)) for t in trajs)), 10)
            await asyncio.sleep(0.2)  # health checks of the wedge went on meanwhile
            return results, gen.counters, sup.stats(), wedge.n_generate, launched
        finally:
            await sup.close()
            await wedge.stop()

    results, counters, stats, n_wedged, launched = asyncio.run(main())
    assert [r.output_ids for r in results] == [[4]] * 3, "a request was lost"
    assert n_wedged == 3 and counters["n_engine_resubmits"] == 3
    assert stats == {"n_engine_failures": 1, "n_engine_restarts": 1, "n_engines_live": 1} and len(launched) == 1


def test_the_automatic_deadline_follows_the_measured_speed():
    d = GenerateDeadlines("auto")
    assert d.limit_s(100, 1, "e0") == AUTO_UNMEASURED_S  # nothing measured yet
    d.observe(seconds=2.0, n_tokens=9, in_flight=2, engine="e0")  # 0.2 s per token, 0.1 per request in flight
    d.observe(seconds=1.0, n_tokens=4, in_flight=1, engine="e0")  # 0.2 s per token, 0.2 per request in flight
    assert d.limit_s(99, 1, "e0") == pytest.approx(4 * 100 * 0.2)  # 80 s
    assert d.limit_s(99, 4, "e0") == pytest.approx(4 * 100 * 0.2 * 4)  # 320 s: four share the engine's speed
    assert d.limit_s(9, 1, "e0") == AUTO_MIN_S  # 8 s predicted, below the floor
    assert d.limit_s(9, 1, "e0 restarted") == AUTO_UNMEASURED_S  # its first, cold requests
    assert GenerateDeadlines(0).limit_s(10**6, 100) is None and GenerateDeadlines(2.5).limit_s(1, 1) == 2.5
    for bad in (-1, "soon", True):
        with pytest.raises(ConfigError, match="rollout.generate_timeout_s"):
            GenerateDeadlines(bad)


def test_a_deadline_waits_out_a_weight_update_and_misses_otherwise():
    async def finishing_after(s):
        await asyncio.sleep(s)
        return GenerateResult("r", [4, 4], [-1.0, -1.0], [0, 0], "stop")

    async def main():
        d = GenerateDeadlines(0.1)
        held = await d.run(finishing_after(0.35), 4, 1, paused=lambda: True)
        with pytest.raises(DeadlineMissed, match="within 0.1 s"):
            await d.run(finishing_after(0.35), 4, 1, paused=lambda: False)
        return held

    assert asyncio.run(main()).output_ids == [4, 4]


def test_the_config_key_reaches_the_check():
    from megarl.builder import load_run_config

    assert load_run_config(None, []).rollout.generate_timeout_s == "auto"
    assert load_run_config(None, ["rollout.generate_timeout_s=12"]).rollout.generate_timeout_s == 12.0
    with pytest.raises(ConfigError, match="generate_timeout_s"):
        load_run_config(None, ["rollout.generate_timeout_s=soon"])
