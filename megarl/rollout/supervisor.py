"""Engine supervision: notice a dead or silent engine, restart it with the current weights, or drop it.

::

    generation.generate  ──► EngineSupervisor.generate ──► least-loaded live engine
         ▲  EngineLost: the engine died with the request         │ EngineError
         └─ wait_available(), resubmit prompt + partial ◄── probe: process exited, or /health silent?
                                                               yes ─► fail(engine) ─► restart task
    health loop, every rollout.health_interval_s: process exited, or no /health answer within
                 rollout.health_timeout_s ─► fail(engine); a request past rollout.generate_timeout_s too
    restart:     stop what is left of it; launch it from the base checkpoint; under the publish lock,
                 load the last published weights with their version (update_weights_from_disk; the
                 publisher keeps that directory until the next publish, which waits for the lock);
                 route to it again.
                 After rollout.max_engine_restarts failed launches the engine is dropped (capacity
                 reduced); with no engine left, ``failure`` is set and ``wait_available`` raises it.

publish:     every engine's weight update (disk or broadcast) has rollout.publish_timeout_s; an engine
                 that misses it is failed and restarted like a dead one (it then loads that version),
                 the others keep what they loaded, and the publish returns. The same deadline holds for
                 the requests a publish aborted: engines still holding some after it are restarted
                 (fail_busy), which returns those requests as lost. The calls to every live engine
                 (weight updates, abort, pause, resume) are EngineFanOut's, megarl/rollout/engine_fanout.py.

A request that fails on an engine that still answers /health is a real error
(e.g. the engine refused it) and is raised as is; only a request whose engine
is gone becomes :class:`EngineLost`, which the controller sends again (same
request id, hence the same sampling seed). Publishing keeps working while an
engine restarts: it updates the live engines, and the restarted one catches up
before it serves. A broadcast update goes to the engines live at that moment:
the publisher makes its group for exactly them (``group_info`` as a callable,
megarl/rollout/publish.py), and a restarted engine, which cannot join a group of fixed
size, loads the disk copy of the same version the publisher names (``weights``).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megarl.errors import EngineError
from megarl.rollout.client import stop_engine_process
from megarl.rollout.engine_fanout import EngineFanOut
from megarl.rollout.generate_deadline import DeadlineMissed, GenerateDeadlines
from megarl.stop_protocol import stop_budget
from megarl.types import GenerateRequest, GenerateResult

log = logging.getLogger("megarl.supervisor")


class EngineLost(EngineError):
    """The engine serving a request died or stopped answering; the request may be sent again."""


@dataclass
class _Slot:
    index: int
    client: Any
    proc: Any = None  # the Popen of an engine this process started (None: started by someone else)
    state: str = "live"  # live | restarting | dropped
    incarnation: int = 0
    in_flight: int = 0
    launches: int = 0


#: launch(engine index) -> (Popen, client) of an engine serving the base checkpoint; blocking, run in a thread
Launcher = Callable[[int], tuple[Any, Any]]


class EngineSupervisor(EngineFanOut):
    """The controller's router (the :class:`~megarl.rollout.router.EngineRouter` interface) with supervision.

    ``engines`` are ``(proc, client)`` pairs serving the base checkpoint
    (proc None: started by someone else, who stops it);
    ``launch`` starts engine i again (None: engines cannot be restarted and a
    failed one is dropped); ``weights`` is ``(weights dir, version)`` the engines
    must serve (version 0: the base checkpoint itself). ``await start()`` loads
    them into the engines and starts the health checks; :meth:`close` at the end
    stops the engine processes.
    """

    def __init__(self, engines: list[tuple[Any, Any]], *, launch: Launcher | None, weights: tuple[str, int],
                 health_interval_s: float = 5.0, health_timeout_s: float = 30.0, max_restarts: int = 3,
                 work_dir: str | Path | None = None, stop: Callable[[Any, float], Any] | None = None,
                 publish_timeout_s: float = 0.0, generate_timeout_s: float | str = 0.0) -> None:
        if not engines:
            raise EngineError("EngineSupervisor needs at least one engine")
        self.slots = [_Slot(i, client, proc) for i, (proc, client) in enumerate(engines)]
        self.launch = launch
        self.weights = (str(weights[0]), int(weights[1]))
        #: awaited before a restarted engine loads ``weights``: a copy still being written (broadcast publishes)
        self.weights_ready: Callable[[], Any] | None = None
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_restarts = max_restarts
        #: seconds each engine has for a weight update (0 = no limit; the module doc says what happens after)
        self.publish_timeout_s = publish_timeout_s
        self.deadlines = GenerateDeadlines(generate_timeout_s)  # rollout.generate_timeout_s (generate_deadline.py)
        self.work_dir = Path(work_dir) if work_dir else None
        #: stop(proc, timeout_s): ends an engine process and its children
        self.stop = stop or stop_engine_process
        #: the same at the end of the run, without waiting for the engines' orderly shutdown
        self._stop_at_close = stop or functools.partial(stop_engine_process, wait=False)
        #: set when no engine is left; wait_available raises it
        self.failure: EngineError | None = None
        self.n_failures = 0
        self.n_restarts = 0
        self._publish_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._launching: set[asyncio.Future] = set()  # restarts whose process may still appear
        self._closed = False
        for slot in self.slots:
            self._write_pid(slot)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.weights[1] != 0:  # a resumed run: the engines start from the base checkpoint
            async with self._publish_lock:
                await self._each_live(lambda s: s.client.update_weights_from_disk(*self.weights),
                                      timeout_s=self.publish_timeout_s)
        self._spawn(self._health_loop())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop supervising, close the clients and stop every engine process this supervisor holds."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for launch in list(self._launching):  # a restart still starting: stop what it brings up
            try:  # while a run stops, for what is left of logging.stop_grace_s (megarl/stop_protocol.py)
                proc, client = await asyncio.wait_for(asyncio.shield(launch), stop_budget.remaining())
            except asyncio.TimeoutError:
                stop_budget.unfinished("an engine restart still starting at close (it exits with this process)")
                continue
            except Exception:  # noqa: BLE001 - it failed to start: nothing to stop
                continue
            await client.close()
            if proc is not None:  # None: a pooled engine (megarl/rollout/engine_pool.py), the pool stops it
                await asyncio.to_thread(self.stop, proc, 30.0)
        await asyncio.gather(*(s.client.close() for s in self.slots), return_exceptions=True)
        procs = [s.proc for s in self.slots if s.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(self._stop_at_close, p, stop_budget.bound(30.0)) for p in procs),
                             return_exceptions=True)

    def _write_pid(self, slot: _Slot) -> None:
        if self.work_dir is not None and slot.proc is not None:
            (self.work_dir / f"engine{slot.index}.pid").write_text(f"{slot.proc.pid}\n")

    # -- routing ------------------------------------------------------------------------
    def _live(self) -> list[_Slot]:
        return [s for s in self.slots if s.state == "live"]

    async def wait_available(self) -> None:
        """Return once an engine is live; raise ``failure`` when none will be."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._live() or self.failure is not None)
        if not self._live():
            raise self.failure

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        live = self._live()
        if not live:
            raise EngineLost(f"no engine is up for request {req.request_id}")
        slot = min(live, key=lambda s: s.in_flight)
        incarnation = slot.incarnation
        slot.in_flight += 1
        try:
            return await self.deadlines.run(slot.client.generate(req), req.sampling.max_new_tokens, slot.in_flight,
                                            self._publish_lock.locked, engine=(slot.index, incarnation))
        except EngineError as e:
            if isinstance(e, EngineLost):
                raise
            if isinstance(e, DeadlineMissed) or slot.incarnation != incarnation or await self._is_gone(slot):
                self._fail(slot, incarnation, f"request {req.request_id} failed ({e})")
                raise EngineLost(f"engine {slot.index} lost request {req.request_id}: {e}") from e
            raise
        finally:
            slot.in_flight -= 1

    async def _is_gone(self, slot: _Slot) -> bool:
        if slot.state != "live":
            return True
        if slot.proc is not None and slot.proc.poll() is not None:
            return True
        try:
            health = await asyncio.wait_for(slot.client.health(), self.health_timeout_s)
        except (EngineError, asyncio.TimeoutError):
            return True
        return not health.get("ok", True)  # the server answers but its engine core is dead

    # -- failure and restart -------------------------------------------------------------
    def _fail(self, slot: _Slot, incarnation: int, reason: str) -> None:
        if slot.state != "live" or slot.incarnation != incarnation:
            return  # already being handled
        slot.state = "restarting"
        slot.incarnation += 1
        self.n_failures += 1
        log.warning("engine %d failed: %s; restarting it with version %d", slot.index, reason, self.weights[1])
        self._spawn(self._restart(slot))

    async def _restart(self, slot: _Slot) -> None:
        old_proc, old_client = slot.proc, slot.client
        await old_client.close()
        if old_proc is not None:  # a silent engine must stop for good; also reaps its engine-core children
            await asyncio.to_thread(self.stop, old_proc, 5.0)
        # no restart once the run stops: a stop signal may have reached the engine as well (the same preemption)
        while (self.launch is not None and slot.launches < self.max_restarts and not self._closed
               and not stop_budget.started):
            slot.launches += 1
            launch = asyncio.ensure_future(asyncio.to_thread(self.launch, slot.index))
            self._launching.add(launch)
            try:
                proc, client = await asyncio.shield(launch)  # cancelled by close(), which stops it
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed launch is retried, then the engine dropped
                self._launching.discard(launch)
                log.warning("engine %d: restart %d failed: %s", slot.index, slot.launches, e)
                continue
            self._launching.discard(launch)
            async with self._publish_lock:  # no publish between loading the weights and serving
                try:
                    if self._closed:
                        raise EngineError("supervisor closed")
                    if self.weights[1] != 0:
                        if self.weights_ready is not None:
                            await self.weights_ready()
                        await client.update_weights_from_disk(*self.weights)
                except EngineError as e:
                    log.warning("engine %d: restarted engine refused weights version %d: %s", slot.index,
                                self.weights[1], e)
                    await client.close()
                    if proc is not None:
                        await asyncio.to_thread(self.stop, proc, 5.0)
                    continue
                slot.proc, slot.client, slot.state = proc, client, "live"
                self.n_restarts += 1
                self._write_pid(slot)
            log.warning("engine %d restarted (pid %s) at version %d", slot.index, getattr(proc, "pid", "-"),
                        self.weights[1])
            await self._notify()
            return
        slot.state = "dropped"
        slot.proc = None
        log.error("engine %d dropped after %d restart attempt(s); %d engine(s) left", slot.index, slot.launches,
                  len(self._live()))
        if not any(s.state != "dropped" for s in self.slots):
            self.failure = EngineError(f"every rollout engine failed and could not be restarted "
                                       f"(rollout.max_engine_restarts={self.max_restarts}); see the engine logs")
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            if self._publish_lock.locked():  # a weight update may keep an engine from answering
                continue
            await asyncio.gather(*(self._check(s) for s in self._live()))

    async def _check(self, slot: _Slot) -> None:
        incarnation = slot.incarnation
        if slot.proc is not None and slot.proc.poll() is not None:
            self._fail(slot, incarnation, f"process {slot.proc.pid} exited with code {slot.proc.returncode}")
            return
        try:
            health = await asyncio.wait_for(slot.client.health(), self.health_timeout_s)
        except asyncio.TimeoutError:
            self._fail(slot, incarnation, f"no /health answer within {self.health_timeout_s:.0f} s")
            return
        except EngineError as e:
            self._fail(slot, incarnation, f"/health failed ({e})")
            return
        if not health.get("ok", True):  # e.g. vLLM's engine core died behind a live HTTP server
            self._fail(slot, incarnation, f"/health reports the engine is not ok: {health}")

    def fail_busy(self, reason: str) -> None:
        """Fail (restart) every live engine that holds requests: closing its client returns them as lost."""
        for slot in self._live():
            if slot.in_flight:
                self._fail(slot, slot.incarnation, reason)

    def stats(self) -> dict[str, int]:
        """Per-run totals for the step record."""
        return {"n_engine_failures": self.n_failures, "n_engine_restarts": self.n_restarts,
                "n_engines_live": len(self._live())}

    # -- health report --------------------------------------------------------------------
    async def health(self) -> dict:
        live = self._live()
        engines = await asyncio.gather(*(s.client.health() for s in live), return_exceptions=True)
        engines = [h if isinstance(h, dict) else {"ok": False, "error": str(h)} for h in engines]
        return {"ok": bool(live) and all(h.get("ok") for h in engines), "backend": "supervisor",
                "engines": engines, "states": [s.state for s in self.slots], **self.stats(),
                "in_flight": sum(s.in_flight for s in self.slots)}
