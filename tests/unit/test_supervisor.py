"""EngineSupervisor with in-process stand-ins for engine processes and their HTTP clients.

The real thing (a vLLM engine process SIGKILLed mid-run) is tests/e2e/test_resume.py;
here the failure modes are driven one at a time: a request on a dead engine, a
dead engine nobody is talking to, a request an alive engine refuses, failed restarts.
"""
import asyncio

import pytest

from megarl.config.schema import RolloutConfig
from megarl.errors import EngineError
from megarl.rollout.supervisor import EngineLost, EngineSupervisor
from megarl.types import GenerateRequest, GenerateResult


class FakeProc:
    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeEngine:
    """An engine client; ``die()`` makes it behave like a SIGKILLed engine process."""

    def __init__(self, pid):
        self.proc = FakeProc(pid)
        self.alive = True
        self.version = 0
        self.updates = []
        self.refuse = False
        self.core_dead = False
        self.n_workers = 1

    def die(self):
        self.alive = False
        self.proc.returncode = -9

    def core_dies(self):
        """The HTTP server lives on but its engine core is dead (vLLM's EngineDeadError): /health says ok=false."""
        self.core_dead = True

    async def generate(self, req):
        await asyncio.sleep(0.01)
        if not self.alive:
            raise EngineError("engine unreachable (ClientConnectorError)")
        if self.refuse:
            raise EngineError("refused")
        if self.core_dead:
            raise EngineError("vLLM failed on request: EngineDeadError: EngineCore encountered an issue")
        return GenerateResult(req.request_id, [4], [-1.0], [self.version], "stop")

    async def health(self):
        if not self.alive:
            raise EngineError("engine unreachable")
        return {"ok": not self.core_dead, "version": self.version, "n_workers": self.n_workers}

    async def update_weights_from_disk(self, path, version):
        if not self.alive:
            raise EngineError("engine unreachable")
        self.updates.append((path, version))
        self.version = version

    async def update_weights_from_broadcast(self, group_info, names_shapes_dtypes, version):
        if not self.alive:
            raise EngineError("engine unreachable")
        self.updates.append((f"rank {group_info['rank']}", version))
        self.version = version

    async def abort_all(self):
        if not self.alive:
            raise EngineError("engine unreachable")

    async def close(self):
        pass


def make(n=2, launch_fails=False, **kw):
    engines = [FakeEngine(1000 + i) for i in range(n)]
    launched = []
    stopped = []

    def launch(i):
        if launch_fails:
            launched.append(None)
            raise EngineError("engine exited with code 1 before serving")
        e = FakeEngine(2000 + len(launched))
        launched.append(e)
        return e.proc, e

    sup = EngineSupervisor([(e.proc, e) for e in engines], launch=launch, weights=("/ckpt", 0),
                           health_interval_s=kw.pop("health_interval_s", 60.0),
                           health_timeout_s=kw.pop("health_timeout_s", 1.0),
                           stop=lambda proc, timeout: stopped.append(proc.pid), **kw)
    return sup, engines, launched, stopped


def req(i=0):
    return GenerateRequest(f"g0-{i}/0/0", [1, 5, 2])


def test_request_on_dead_engine_is_lost_and_engine_restarted_with_current_weights():
    async def main():
        sup, engines, launched, stopped = make()
        await sup.start()
        await sup.update_weights_from_disk("/run/weights/v3", 3)
        engines[0].die()
        with pytest.raises(EngineLost):
            await sup.generate(req())  # least loaded: engine 0
        assert sup.stats()["n_engines_live"] == 1
        assert (await sup.generate(req(1))).versions == [3]  # engine 1 serves meanwhile
        await sup.wait_available()
        for _ in range(100):
            if sup.stats()["n_engine_restarts"]:
                break
            await asyncio.sleep(0.01)
        assert sup.stats() == {"n_engine_failures": 1, "n_engine_restarts": 1, "n_engines_live": 2}
        assert launched[0].updates == [("/run/weights/v3", 3)], "restarted engine loads the published weights"
        assert stopped == [1000], "what was left of the dead engine is stopped"
        assert sup.slots[0].client is launched[0]
        await sup.close()

    asyncio.run(main())


@pytest.mark.parametrize("failure", ["die", "core_dies"])
def test_health_check_finds_a_dead_engine_without_requests(failure):
    async def main():
        sup, engines, launched, _ = make(n=1, health_interval_s=0.02)
        await sup.start()
        getattr(engines[0], failure)()
        for _ in range(200):
            if sup.stats()["n_engine_restarts"]:
                break
            await asyncio.sleep(0.01)
        assert sup.stats()["n_engine_restarts"] == 1 and launched
        await sup.close()

    asyncio.run(main())


def test_an_engine_whose_core_died_behind_a_live_server_is_restarted():
    # requests failing on it must not be taken for bad requests (the loop would drop group after group)
    async def main():
        sup, engines, launched, _ = make(n=1)
        await sup.start()
        engines[0].core_dies()
        with pytest.raises(EngineLost):
            await sup.generate(req())
        await sup.wait_available()
        assert sup.stats()["n_engine_restarts"] == 1 and sup.slots[0].client is launched[0]
        assert (await sup.generate(req(1))).output_ids == [4]
        await sup.close()

    asyncio.run(main())


def test_refused_request_on_a_live_engine_is_an_error_not_a_loss():
    async def main():
        sup, engines, _, _ = make(n=1)
        engines[0].refuse = True
        with pytest.raises(EngineError) as e:
            await sup.generate(req())
        assert not isinstance(e.value, EngineLost)
        assert sup.stats()["n_engine_failures"] == 0
        await sup.close()

    asyncio.run(main())


def test_publish_while_an_engine_is_down_and_dropping_after_failed_restarts():
    async def main():
        sup, engines, launched, _ = make(n=2, launch_fails=True, max_restarts=2)
        engines[1].die()
        await sup.update_weights_from_disk("/run/weights/v1", 1)  # engine 1 is found gone, not an error
        assert engines[0].version == 1
        for _ in range(200):
            if sup.slots[1].state == "dropped":
                break
            await asyncio.sleep(0.01)
        assert sup.slots[1].state == "dropped" and sup.failure is None  # capacity reduced, run goes on
        await sup.wait_available()
        engines[0].die()
        with pytest.raises(EngineLost):
            await sup.generate(req())
        with pytest.raises(EngineError, match="every rollout engine failed"):
            await asyncio.wait_for(sup.wait_available(), 5)
        await sup.close()

    asyncio.run(main())


def test_broadcast_goes_to_the_live_engines_with_ranks_in_order():
    """The publisher's group is made for the engines live under the publish lock (megarl/rollout/publish.py)."""
    async def main():
        sup, engines, _, _ = make(n=3, max_restarts=0)
        engines[0].die()
        await sup.update_weights_from_disk("/run/weights/v1", 1)  # engine 0 is found gone, then dropped
        groups = []

        def open_group(members):
            groups.append(members)
            return {"group_id": f"g{len(groups)}"}

        await sup.update_weights_from_broadcast(open_group, [], 2, weights=("/run/weights/v2", 2))
        assert groups == [[(1, 0, 1), (2, 0, 1)]]
        assert [e.updates[-1] for e in engines[1:]] == [("rank 1", 2), ("rank 2", 2)]
        assert sup.weights == ("/run/weights/v2", 2), "a restarted engine would load the disk copy of v2"
        await sup.update_weights_from_broadcast(lambda members: None, [], 3, weights=("/run/weights/v3", 3))
        assert engines[1].version == 2 and sup.weights == ("/run/weights/v3", 3)
        engines[1].n_workers = 2  # a vLLM engine with tensor parallelism 2: ranks 1 and 2
        await sup.update_weights_from_broadcast(open_group, [], 4)
        assert groups[-1] == [(1, 0, 2), (2, 0, 1)]
        assert [e.updates[-1] for e in engines[1:]] == [("rank 1", 4), ("rank 3", 4)]
        with pytest.raises(EngineError, match="does not fit"):  # a fixed group needs every engine live
            await sup.update_weights_from_broadcast({"world_size": 4}, [], 5)
        engines[2].die()  # silent so far: found by the worker-count question, so no group waits for it
        await sup.update_weights_from_broadcast(open_group, [], 6)
        assert groups[-1] == [(1, 0, 2)] and sup.slots[2].state != "live"
        await sup.close()

    asyncio.run(main())


def test_an_engine_that_wedges_while_loading_weights_is_restarted_with_that_version():
    """A publish has a deadline (rollout.publish_timeout_s): the engine that misses it is restarted and loads the
    version there; the others keep what they loaded and the publish returns."""
    async def main():
        sup, engines, launched, stopped = make(publish_timeout_s=0.3)
        await sup.start()

        async def wedged(path, version):
            await asyncio.Event().wait()  # never finishes loading

        engines[1].update_weights_from_disk = wedged
        await asyncio.wait_for(sup.update_weights_from_disk("/run/weights/v1", 1), 5)
        assert engines[0].version == 1 and stopped == [1001]
        for _ in range(100):
            if sup.stats()["n_engine_restarts"] == 1:
                break
            await asyncio.sleep(0.02)
        assert launched[0].updates == [("/run/weights/v1", 1)]
        assert sup.stats() == {"n_engine_failures": 1, "n_engine_restarts": 1, "n_engines_live": 2}
        await sup.close()

    asyncio.run(main())


def test_a_publish_deadline_is_in_the_config():
    from megarl.builder import load_run_config

    assert load_run_config(None, []).rollout.publish_timeout_s == 600.0


class WedgedEngine(FakeEngine):
    """Answers /health and abort, but a request never returns, until its client is closed (then the
    connection drops, as an HTTP client's in-flight request does when its session closes)."""

    def __init__(self, pid):
        super().__init__(pid)
        self._closed = asyncio.Event()

    async def generate(self, req):
        await self._closed.wait()
        raise EngineError("engine unreachable (ServerDisconnectedError: Server disconnected)")

    async def close(self):
        self._closed.set()


def test_a_publish_whose_drain_misses_the_deadline_restarts_the_engine_holding_the_requests():
    """An engine that keeps a request after a publish's abort: the wait for it ends at rollout.publish_timeout_s,
    the supervisor restarts that engine, the request comes back as lost and is sent again after the publish."""
    from megarl.rollout.interruptible import InterruptibleGeneration
    from megarl.types import SamplingParams, Trajectory

    async def main():
        wedged = WedgedEngine(1000)
        launched, stopped = [], []

        def launch(i):
            e = FakeEngine(2000 + len(launched))
            launched.append(e)
            return e.proc, e

        sup = EngineSupervisor([(wedged.proc, wedged)], launch=launch, weights=("/ckpt", 0), health_interval_s=60.0,
                               health_timeout_s=1.0, stop=lambda proc, timeout: stopped.append(proc.pid))
        await sup.start()
        gen = InterruptibleGeneration(sup, RolloutConfig(max_concurrency=4), seed=0,
                                      counters={"n_interrupted": 0, "n_engine_resubmits": 0,
                                                "n_engine_prefix_cached_tokens": 0})
        traj = Trajectory(traj_id="g0-0", group_id="g0", prompt_ids=[1, 5, 2])
        turn = asyncio.create_task(gen.generate(traj, [1, 5, 2], SamplingParams(max_new_tokens=4)))
        await asyncio.sleep(0.05)
        gen.close()  # a publish: stop, abort, wait for the requests in flight
        await sup.abort_all()
        await asyncio.wait_for(gen.drained(timeout_s=0.3), 5)
        assert stopped == [1000] and gen.n_inflight == 0
        gen.open()
        result = await asyncio.wait_for(turn, 5)
        assert result.output_ids == [4] and launched and sup.stats()["n_engine_restarts"] == 1
        assert gen.counters["n_engine_resubmits"] == 1
        await sup.close()

    asyncio.run(main())


def test_an_engine_that_does_not_answer_a_publishs_abort_is_restarted_within_the_health_timeout():
    """A stopped engine (SIGSTOP) holding no request: the publish's /abort_all is what finds it. The call is
    bounded by rollout.health_timeout_s like /health, so the publish goes on with the other engine and the silent
    one is restarted, instead of waiting out the HTTP client's own limit and a /health probe after it."""
    async def main():
        sup, engines, launched, stopped = make(health_timeout_s=0.3)
        await sup.start()

        async def silent():
            await asyncio.Event().wait()

        engines[0].abort_all = silent
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(sup.abort_all(), 5)
        assert asyncio.get_running_loop().time() - t0 < 1.0
        assert stopped == [1000]
        for _ in range(100):
            if sup.stats()["n_engine_restarts"] == 1:
                break
            await asyncio.sleep(0.02)
        assert sup.stats() == {"n_engine_failures": 1, "n_engine_restarts": 1, "n_engines_live": 2}
        await sup.close()

    asyncio.run(main())
