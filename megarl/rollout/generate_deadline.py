"""Deadlines of ``/generate`` requests, so that a wedged engine is restarted instead of holding its requests.

A vLLM engine whose HTTP loop still answers ``/health`` while its requests
never finish passes every health check (vLLM's health says only "not
errored"); without a deadline its requests wait until the run stops on
``trainer.stall_timeout_s``. With one, the supervisor treats a request past
its deadline as a sign that its engine is gone: the engine is failed and
restarted like a dead one, and every request it held comes back as
:class:`~megarl.rollout.supervisor.EngineLost` and is sent again
(megarl/rollout/supervisor.py).

``rollout.generate_timeout_s`` is the deadline of every request in seconds
(0 = none) or ``auto``: from the speed the engines have shown on the
requests they finished (the last :data:`WINDOW`), a request of ``max_tokens``
submitted while ``n`` requests are in flight on its engine gets::

    AUTO_SLACK * (max_tokens + 1) * max(s_token, s_token_each * n)      at least AUTO_MIN_S

with ``s_token`` the largest seconds per token of one request (queueing and
prefill included) and ``s_token_each`` the largest of that divided by the
requests in flight beside it: the first bounds a batch that runs requests side
by side, the second one that shares its speed among them. Until an engine has
finished a request (its first, cold calls, also after each restart) its
requests' deadline is :data:`AUTO_UNMEASURED_S`. A deadline that passes while a weight update holds
the engines is extended by another period: the update has its own limit
(``rollout.publish_timeout_s``).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Callable

from megarl.errors import ConfigError, EngineError
from megarl.types import GenerateResult

#: how many times the time the engines' measured speed predicts a request may take
AUTO_SLACK = 4.0
#: the shortest automatic deadline (short requests also wait in the engine's queue)
AUTO_MIN_S = 30.0
#: the automatic deadline before any request finished
AUTO_UNMEASURED_S = 600.0
#: finished requests the automatic deadline is measured on
WINDOW = 256


class DeadlineMissed(EngineError):
    """A request did not finish by its deadline: its engine is taken for wedged."""


def check_generate_timeout(value: float | str) -> float | str:
    """``rollout.generate_timeout_s`` as given, or ConfigError naming what is allowed."""
    if value == "auto" or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        return value
    raise ConfigError(f"rollout.generate_timeout_s={value!r}: give seconds per request (> 0), 0 for no deadline, "
                      f"or auto (from the engines' measured speed)")


class GenerateDeadlines:
    """The deadline of each request of one supervisor's engines (module doc)."""

    def __init__(self, timeout_s: float | str = "auto") -> None:
        self.timeout_s = check_generate_timeout(timeout_s)
        #: (seconds per token, the same per request in flight) of the last finished requests
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        #: the engines (e.g. index and incarnation) that have finished a request
        self._warm: set = set()

    def limit_s(self, max_tokens: int, in_flight: int, engine=None) -> float | None:
        """Seconds a request of ``max_tokens`` submitted to ``engine`` beside ``in_flight`` requests (itself
        included) may take; None: no deadline."""
        if self.timeout_s != "auto":
            return float(self.timeout_s) or None
        if not self._recent or engine not in self._warm:
            return AUTO_UNMEASURED_S
        s_token = max(s for s, _ in self._recent)
        s_token_each = max(s for _, s in self._recent)
        predicted = (max_tokens + 1) * max(s_token, s_token_each * max(1, in_flight))
        return max(AUTO_MIN_S, AUTO_SLACK * predicted)

    def observe(self, seconds: float, n_tokens: int, in_flight: int, engine=None) -> None:
        """A request that ``engine`` finished in ``seconds`` with ``n_tokens`` generated beside ``in_flight``
        requests."""
        self._warm.add(engine)
        per_token = seconds / (n_tokens + 1)
        self._recent.append((per_token, per_token / max(1, in_flight)))

    async def run(self, call: Awaitable[GenerateResult], max_tokens: int, in_flight: int,
                  paused: Callable[[], bool], engine=None) -> GenerateResult:
        """``await call`` (a request to ``engine``) within its deadline; DeadlineMissed (the call cancelled) past
        it, unless ``paused()`` (a weight update holds the engines) says to wait another period."""
        limit = self.limit_s(max_tokens, in_flight, engine)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.ensure_future(call)
        try:
            while limit is not None:
                done, _ = await asyncio.wait({task}, timeout=limit)
                if done:
                    break
                if not paused():
                    raise DeadlineMissed(f"no answer to /generate within {limit:.1f} s (rollout.generate_timeout_s="
                                         f"{self.timeout_s}; max_tokens={max_tokens}, {in_flight} in flight)")
            result = await task
        finally:
            if not task.done():
                task.cancel()
        self.observe(loop.time() - t0, len(result.output_ids), in_flight, engine)
        return result
