"""Fan-out calls of the supervised router: one call on every live engine, weight updates under the publish lock.

:class:`EngineFanOut` is the part of :class:`~megarl.rollout.supervisor.EngineSupervisor`
that sends a call to each live engine and gathers the answers: weight updates
(disk or broadcast, each with ``rollout.publish_timeout_s``), abort, pause,
resume (each with ``rollout.health_timeout_s``: they are control calls an
engine answers at once, like /health) and the served version. An engine found
gone, or past its call's deadline, is failed (restarted) by the supervisor, so
a wedged engine holds a publish's abort for ``rollout.health_timeout_s`` at
most; the failure and restart policy is megarl/rollout/supervisor.py's module doc.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from megarl.errors import EngineError
from megarl.rollout.base import slowest_phases
from megarl.rollout.router import group_ranks

if TYPE_CHECKING:  # the supervisor's engine slot; never imported at run time (supervisor.py imports this module)
    from megarl.rollout.supervisor import _Slot


class EngineFanOut:
    """The fan-out calls of :class:`~megarl.rollout.supervisor.EngineSupervisor`, which inherits them.

    They use the supervisor's ``slots``, ``weights``, ``weights_ready``,
    ``health_timeout_s``, ``publish_timeout_s``, ``_publish_lock``, ``_live()``,
    ``_fail()`` and ``_is_gone()``.
    """

    async def _each_live(self, call: Callable[[_Slot], Any], slots: list[_Slot] | None = None,
                         timeout_s: float = 0.0, what: str = "weight update",
                         limit_key: str = "rollout.publish_timeout_s") -> list:
        """``call`` on every live engine; an engine found gone, or (``timeout_s`` > 0) not done after that
        long (``what``, whose limit is the config key ``limit_key``), is failed (restarted); others' errors
        raise."""
        slots = self._live() if slots is None else slots
        incarnations = [s.incarnation for s in slots]
        results = await asyncio.gather(*(asyncio.wait_for(call(s), timeout_s or None) for s in slots),
                                       return_exceptions=True)
        errors = []
        for slot, inc, r in zip(slots, incarnations, results):
            if isinstance(r, BaseException):
                if isinstance(r, TimeoutError):  # the client's own time limits come back as EngineError
                    self._fail(slot, inc, f"{what} not done within {timeout_s:g} s ({limit_key})")
                elif isinstance(r, EngineError) and (slot.incarnation != inc or await self._is_gone(slot)):
                    self._fail(slot, inc, f"{type(r).__name__}: {r}")
                else:
                    errors.append((slot.index, r))
        if errors:
            i, err = errors[0]
            raise EngineError(f"{len(errors)} of {len(slots)} engines failed; engine {i}: "
                              f"{type(err).__name__}: {err}") from err
        return [r for r in results if not isinstance(r, BaseException)]

    async def _control(self, path: str, call: Callable[[_Slot], Any]) -> list:
        """A control call on every live engine, bounded like /health (module doc)."""
        return await self._each_live(call, timeout_s=self.health_timeout_s, what=path,
                                     limit_key="rollout.health_timeout_s")

    async def abort_all(self) -> None:
        await self._control("/abort_all", lambda s: s.client.abort_all())

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float] | None:
        """Every live engine loads ``path``; per update phase, the slowest engine's seconds."""
        async with self._publish_lock:
            self.weights, self.weights_ready = (str(path), int(version)), None
            return slowest_phases(await self._each_live(lambda s: s.client.update_weights_from_disk(path, version),
                                                        timeout_s=self.publish_timeout_s))

    async def update_weights_from_broadcast(self, group_info: dict | Callable[[list], dict | None],
                                            names_shapes_dtypes: list, version: int, *,
                                            weights: tuple[str, int] | None = None,
                                            weights_ready: Callable[[], Any] | None = None) -> dict[str, float] | None:
        """Every live engine receives the trainer's broadcast: rank 0 is the trainer, then each engine's workers.

        Under the publish lock the live engines are asked for their worker count
        first (``n_workers`` of /health, 1 if absent: vLLM tensor parallelism);
        one that does not answer is failed (restarted) and left out, so no group
        waits for a dead member. ``group_info``: a dict whose ``world_size`` fits
        every engine (all live), or ``group_info(members) -> dict | None``, with
        ``members`` the answering engines' ``(index, incarnation, n_workers)``:
        the group's info for exactly them, ranks in that order (None: nothing to
        send). ``weights``: the same version on disk, which a restarted engine
        loads from now on, once ``weights_ready()`` (awaited; may raise EngineError)
        says it is written. Returns, per update phase, the slowest engine's
        seconds (None: nothing sent).
        """
        async with self._publish_lock:
            if weights is not None:
                self.weights, self.weights_ready = (str(weights[0]), int(weights[1])), weights_ready
            slots, workers = await self._worker_counts()
            ranks, world = group_ranks(workers)
            first = {slot.index: rank for slot, rank in zip(slots, ranks)}
            if callable(group_info):
                group_info = group_info([(s.index, s.incarnation, n) for s, n in zip(slots, workers)])
                if group_info is None:
                    return None
            elif len(slots) != len(self.slots) or int(group_info.get("world_size", world)) != world:
                raise EngineError(f"broadcast group of world size {group_info.get('world_size')} does not fit "
                                  f"{len(slots)} of {len(self.slots)} engines live with {world - 1} worker(s)")
            return slowest_phases(await self._each_live(lambda s: s.client.update_weights_from_broadcast(
                {**group_info, "rank": first[s.index]}, names_shapes_dtypes, version), slots,
                timeout_s=self.publish_timeout_s))

    async def _worker_counts(self) -> tuple[list[_Slot], list[int]]:
        """The live engines that answer /health, and each one's worker count."""
        slots = self._live()
        incarnations = [s.incarnation for s in slots]
        answers = await asyncio.gather(*(asyncio.wait_for(s.client.health(), self.health_timeout_s) for s in slots),
                                       return_exceptions=True)
        kept, workers = [], []
        for slot, inc, h in zip(slots, incarnations, answers):
            if isinstance(h, BaseException):
                self._fail(slot, inc, f"no /health answer before a weight broadcast ({type(h).__name__}: {h})")
            elif slot.state == "live" and slot.incarnation == inc:
                kept.append(slot)
                workers.append(int(h.get("n_workers", 1)))
        return kept, workers

    async def version(self) -> int:
        return min(await self._each_live(lambda s: s.client.version()))

    async def pause(self) -> None:
        await self._control("/pause", lambda s: s.client.pause())

    async def resume(self) -> None:
        await self._control("/resume", lambda s: s.client.resume())
