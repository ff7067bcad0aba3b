"""Generation that a publish can interrupt: the controller's side of "abort, reload, resume".

:class:`InterruptibleGeneration` sends one policy turn to the router and,
when a publish aborts it, sends prompt + the tokens so far again once the new
weights are loaded, so one turn may hold tokens of several versions (each
token tagged with its own). It owns what a publish needs to stop generation
and start it again: the gate that holds new requests back (:meth:`close`,
:meth:`open`), the count of requests in flight and an event set when none is
(:meth:`drained`), and ``rollout.max_concurrency`` slots.
"""
from __future__ import annotations

import asyncio
import zlib
from dataclasses import replace

from megarl.errors import EngineError
from megarl.rollout.base import RouterProtocol
from megarl.rollout.supervisor import EngineLost
from megarl.types import GenerateRequest, GenerateResult, SamplingParams, Trajectory


class InterruptibleGeneration:
    """Policy turns through ``router``; ``counters`` (shared with the loop) gets n_interrupted, n_engine_resubmits."""

    def __init__(self, router: RouterProtocol, rollout, *, seed: int, counters: dict[str, int]) -> None:
        """``rollout``: the run's RolloutConfig (max_concurrency, routing_replay, routing_replay_strict)."""
        self.router = router
        #: ask engines for MoE routes; and stop on a result without them instead of counting it
        #: (n_routes_missing) and routing those tokens live
        self.return_routes = rollout.routing_replay
        self.strict_routes = rollout.routing_replay_strict
        self.seed = seed
        self.counters = counters
        self._open = asyncio.Event()
        self._open.set()
        self._slots = asyncio.Semaphore(rollout.max_concurrency)
        self.n_inflight = 0
        self._all_returned = asyncio.Event()
        self._all_returned.set()

    def is_open(self) -> bool:
        """Whether new requests may start (no publish under way)."""
        return self._open.is_set()

    def close(self) -> None:
        """Hold new requests back (a publish begins)."""
        self._open.clear()

    def open(self) -> None:
        """Let requests start again (the new weights are loaded, or the run ends)."""
        self._open.set()

    async def drained(self, timeout_s: float = 0.0) -> None:
        """Wait until no request is in flight (aborted ones have returned their partial tokens).

        After ``timeout_s`` (0 = no limit; rollout.publish_timeout_s) the engines still holding requests are
        taken for wedged: ``router.fail_busy`` restarts them (their requests come back as lost and are sent
        again) or raises a clear error, and the wait goes on for what is left.
        """
        if timeout_s:
            try:
                await asyncio.wait_for(self._all_returned.wait(), timeout_s)
                return
            except TimeoutError:
                self.router.fail_busy(f"{self.n_inflight} request(s) still running {timeout_s:g} s after a "
                                      f"publish aborted them (rollout.publish_timeout_s)")
        await self._all_returned.wait()

    async def generate(self, traj: Trajectory, context_ids: list[int], sampling: SamplingParams,
                       counted: bool = True) -> GenerateResult:
        """One policy turn; survives interruption by resubmitting prompt + partial tokens.

        Policy tokens are appended to ``traj`` as they arrive (partial chunks
        too), so recovery hooks always see every token with its version. The
        returned result holds the whole turn. ``counted=False`` (evaluation)
        keeps the request out of the counters.
        """
        out_ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        remaining = sampling.max_new_tokens
        chunk = 0
        while True:
            await self._open.wait()
            await self._slots.acquire()  # at most rollout.max_concurrency requests in flight
            if not self._open.is_set():  # a publish began while this request waited for a slot
                self._slots.release()
                continue
            rid = f"{traj.traj_id}/{len(traj.response_ids)}/{chunk}"
            # a distinct, reproducible seed per trajectory and resubmission
            seed = (self.seed * 1_000_003 + zlib.crc32(rid.encode())) % (2**31)
            req = GenerateRequest(rid, context_ids + out_ids, replace(sampling, max_new_tokens=remaining, seed=seed),
                                  return_routes=self.return_routes)
            self.n_inflight += 1
            self._all_returned.clear()
            try:
                res = await self.router.generate(req)
            except EngineLost:
                res = None
            finally:
                self._slots.release()
                self.n_inflight -= 1
                if self.n_inflight == 0:
                    self._all_returned.set()
            if res is None:  # its engine died and took this chunk with it: send it again once one is up
                self.counters["n_engine_resubmits"] += counted
                await self.router.wait_available()
                continue
            if self.return_routes:
                self._take_routes(traj, req, res, counted)
            traj.append_policy(res.output_ids, res.logp_behav, res.versions)
            out_ids += res.output_ids
            logps += res.logp_behav
            versions += res.versions
            remaining -= len(res.output_ids)
            chunk += 1
            if res.finish_reason != "abort":
                return GenerateResult(traj.traj_id, out_ids, logps, versions, res.finish_reason)
            traj.n_interrupts += 1
            self.counters["n_interrupted"] += counted
            if remaining <= 0:
                return GenerateResult(traj.traj_id, out_ids, logps, versions, "length")

    def _take_routes(self, traj: Trajectory, req: GenerateRequest, res: GenerateResult, counted: bool) -> None:
        """Merge the engine's routes into ``traj`` (before its tokens are appended): they cover ``req.prompt_ids``
        + the output, which must be the trajectory's tokens so far for positions to line up (an agent turn
        rendered anew is not: its routes are dropped and its tokens route live)."""
        aligned = req.prompt_ids == traj.tokens
        if res.routes is not None and aligned:
            traj.merge_routes(res.routes)
            return
        if self.strict_routes:
            raise EngineError(f"request {req.request_id}: the engine returned no MoE routes"
                              if res.routes is None else f"request {req.request_id}: its prompt is not the "
                              f"trajectory's tokens so far, so its routes cannot be placed"
                              + "; rollout.routing_replay_strict=true stops here (false routes such tokens live)")
        self.counters["n_routes_missing"] += counted
