"""Several engines behind one :class:`~megarl.rollout.base.Engine`: least-loaded routing and fan-out.

:class:`EngineRouter` is the unsupervised :class:`~megarl.rollout.base.RouterProtocol`; the loop runs
with its supervised counterpart, :class:`~megarl.rollout.supervisor.EngineSupervisor`.
"""
from __future__ import annotations

import asyncio

from megarl.errors import EngineError
from megarl.rollout.base import slowest_phases
from megarl.types import GenerateRequest, GenerateResult


def group_ranks(worker_counts: list[int]) -> tuple[list[int], int]:
    """First rank of each engine in a weight broadcast group, and the group's size: the trainer is
    rank 0, then every engine's workers in engine order (``worker_counts[i]`` ranks for engine i)."""
    first, rank = [], 1
    for n in worker_counts:
        first.append(rank)
        rank += n
    return first, rank


class EngineRouter:
    """Sends each request to the engine with the fewest in-flight requests (ties: lowest index).

    Control calls go to every engine concurrently. For a broadcast update the
    trainer is rank 0 and the engines' workers follow in engine order: an engine
    with ``n_workers`` workers (vLLM tensor parallelism) takes that many ranks,
    starting at the rank it is given (:meth:`broadcast_layout`).
    """

    def __init__(self, engines: list) -> None:
        if not engines:
            raise EngineError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.in_flight = [0] * len(self.engines)
        #: never set: without supervision an engine's error reaches the caller as it is
        self.failure: EngineError | None = None

    async def wait_available(self) -> None:
        """Every engine counts as available: nothing here restarts or drops one."""

    def stats(self) -> dict[str, int]:
        return {"n_engines_live": len(self.engines)}

    def fail_busy(self, reason: str) -> None:
        """Nothing here restarts an engine: a clear error instead of a wait without end."""
        busy = [i for i, n in enumerate(self.in_flight) if n]
        raise EngineError(f"engine(s) {busy}: {reason}")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        i = min(range(len(self.engines)), key=lambda j: self.in_flight[j])
        self.in_flight[i] += 1
        try:
            return await self.engines[i].generate(req)
        finally:
            self.in_flight[i] -= 1

    async def _all(self, calls) -> list:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            i, err = failed[0]
            if len(failed) == 1 and isinstance(err, EngineError):
                raise err
            raise EngineError(f"{len(failed)} of {len(self.engines)} engines failed; engine {i}: "
                              f"{type(err).__name__}: {err}") from err
        return results

    async def abort_all(self) -> None:
        await self._all(e.abort_all() for e in self.engines)

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float] | None:
        """Every engine loads ``path``; per update phase, the slowest engine's seconds."""
        return slowest_phases(await self._all(e.update_weights_from_disk(path, version) for e in self.engines))

    async def broadcast_layout(self) -> tuple[list[int], int]:
        """(first rank of each engine, world size) of a broadcast group: trainer rank 0, then every
        engine worker; an engine's worker count is ``n_workers`` of its /health (1 if absent)."""
        health = await self._all(e.health() for e in self.engines)
        return group_ranks([int(h.get("n_workers", 1)) for h in health])

    async def update_weights_from_broadcast(self, group_info: dict, names_shapes_dtypes: list,
                                            version: int) -> dict[str, float] | None:
        """``group_info["world_size"]`` must be the layout's (:meth:`broadcast_layout`); returns, per update
        phase, the slowest engine's seconds."""
        first, world = await self.broadcast_layout()
        if int(group_info.get("world_size", world)) != world:
            raise EngineError(f"broadcast group of world size {group_info['world_size']} does not fit the engines' "
                              f"{world - 1} worker(s) + the trainer = {world}")
        return slowest_phases(await self._all(
            e.update_weights_from_broadcast({**group_info, "rank": r}, names_shapes_dtypes, version)
            for r, e in zip(first, self.engines)))

    async def version(self) -> int:
        """The oldest version any engine serves (they agree after a successful update)."""
        return min(await self._all(e.version() for e in self.engines))

    async def health(self) -> dict:
        engines = await asyncio.gather(*(e.health() for e in self.engines), return_exceptions=True)
        engines = [h if isinstance(h, dict) else {"ok": False, "error": str(h)} for h in engines]
        return {"ok": all(h.get("ok") for h in engines), "backend": "router", "engines": engines,
                "version": min((h.get("version", -1) for h in engines), default=-1),
                "in_flight": sum(self.in_flight)}

    async def pause(self) -> None:
        await self._all(e.pause() for e in self.engines)

    async def resume(self) -> None:
        await self._all(e.resume() for e in self.engines)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
