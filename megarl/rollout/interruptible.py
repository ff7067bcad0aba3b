"""Generation that a publish can interrupt: the controller's side of "abort, reload, resume".

:class:`InterruptibleGeneration` sends one policy turn to the router and,
when a publish aborts it, sends prompt + the tokens so far again once the new
weights are loaded, so one turn may hold tokens of several versions (each
token tagged with its own). It owns what a publish needs to stop generation
and start it again: the gate that holds new requests back (:meth:`close`,
:meth:`open`), the count of requests in flight and an event set when none is
(:meth:`drained`), and ``rollout.max_concurrency`` slots.

With ``rollout.splice_at_tokens`` = N it also splices by construction: a
trajectory :attr:`may_hold` picks has its first turn stopped after N policy
tokens and held (no slot, not in flight) until the next publish, then sent on
like an aborted request: its first N tokens are of one version, the rest of a
later one, however fast the trainer and the engines happen to be.
"""
from __future__ import annotations

import asyncio
import zlib
from dataclasses import replace
from typing import Callable

from megarl.errors import EngineError
from megarl.rollout.base import RouterProtocol
from megarl.rollout.supervisor import EngineLost
from megarl.types import GenerateRequest, GenerateResult, SamplingParams, Trajectory

#: the counters :class:`InterruptibleGeneration` keeps in the loop's ``counters``
COUNTERS = ("n_interrupted", "n_engine_resubmits", "n_routes_missing", "n_splice_holds",
            "n_engine_prefix_cached_tokens", "n_engine_generated_tokens")


class InterruptibleGeneration:
    """Policy turns through ``router``; ``counters`` (shared with the loop) gets :data:`COUNTERS`: n_interrupted,
    n_engine_resubmits, n_routes_missing, n_splice_holds, n_engine_prefix_cached_tokens (prompt tokens the engines
    read from their prefix caches) and n_engine_generated_tokens (tokens the engines sampled and returned,
    resubmissions and what a resume then threw away included)."""

    def __init__(self, router: RouterProtocol, rollout, *, seed: int, counters: dict[str, int]) -> None:
        """``rollout``: the run's RolloutConfig (max_concurrency, routing_replay, routing_replay_strict)."""
        self.router = router
        for key in COUNTERS:  # the loop's counters dict gets the ones this class keeps
            counters.setdefault(key, 0)
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
        self.splice_at = rollout.splice_at_tokens
        #: which trajectories a splice hold may stop (the controller's rule); none by default
        self.may_hold: Callable[[Trajectory], bool] = lambda traj: False
        #: trajectories a splice hold stopped (each at most once, at its first turn past splice_at tokens)
        self.held: set[str] = set()
        self._opened = asyncio.Condition()
        self._n_opened = 0  # publishes (and the run's end) that let requests start again

    def is_open(self) -> bool:
        """Whether new requests may start (no publish under way)."""
        return self._open.is_set()

    def close(self) -> None:
        """Hold new requests back (a publish begins)."""
        self._open.clear()

    def open(self) -> None:
        """Let requests start again (the new weights are loaded, or the run ends); held turns go on."""
        self._open.set()
        self._n_opened += 1
        if self.held:  # turns may be waiting for this publish
            asyncio.get_running_loop().create_task(self._wake_held())

    async def _wake_held(self) -> None:
        async with self._opened:
            self._opened.notify_all()

    def _hold_cap(self, traj: Trajectory, produced: int, remaining: int, counted: bool) -> int:
        """Tokens to ask for before a splice hold (0: no hold for this chunk)."""
        if (not self.splice_at or not counted or traj.traj_id in self.held or produced >= self.splice_at
                or self.splice_at - produced >= remaining or not self.may_hold(traj)):
            return 0
        return self.splice_at - produced

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
                       counted: bool = True, carried: int = 0) -> GenerateResult:
        """One policy turn; survives interruption by resubmitting prompt + partial tokens.

        Policy tokens are appended to ``traj`` as they arrive (partial chunks
        too), so recovery hooks always see every token with its version. The
        returned result holds the whole turn. ``counted=False`` (evaluation)
        keeps the request out of the counters. ``carried``: the turn began
        before a restart and its first tokens are ``traj``'s last ``carried``
        (megarl/loop/running_groups.py): it goes on from them, as after an abort.
        """
        k = len(traj.response_ids) - carried
        out_ids: list[int] = list(traj.response_ids[k:])
        logps: list[float] = list(traj.logp_behav[k:])
        versions: list[int] = list(traj.versions[k:])
        remaining = sampling.max_new_tokens - carried
        if carried and remaining <= 0:
            return GenerateResult(traj.traj_id, out_ids, logps, versions, "length")
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
            hold_cap = self._hold_cap(traj, len(out_ids), remaining, counted)
            opened = self._n_opened
            req = GenerateRequest(rid, context_ids + out_ids,
                                  replace(sampling, max_new_tokens=hold_cap or remaining, seed=seed),
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
            self.counters["n_engine_prefix_cached_tokens"] += res.n_cached_tokens * counted
            self.counters["n_engine_generated_tokens"] += len(res.output_ids) * counted
            if self.return_routes:
                self._take_routes(traj, req, res, counted)
            traj.append_policy(res.output_ids, res.logp_behav, res.versions)
            out_ids += res.output_ids
            logps += res.logp_behav
            versions += res.versions
            remaining -= len(res.output_ids)
            chunk += 1
            if hold_cap and res.finish_reason == "length" and len(res.output_ids) == hold_cap:
                self.held.add(traj.traj_id)  # the splice point: wait for the next version, then go on
                self.counters["n_splice_holds"] += 1
                traj.n_interrupts += 1
                async with self._opened:
                    await self._opened.wait_for(lambda opened=opened: self._n_opened > opened)
                continue
            if res.finish_reason != "abort":
                return GenerateResult(traj.traj_id, out_ids, logps, versions, res.finish_reason)
            traj.n_interrupts += 1
            self.counters["n_interrupted"] += counted
            if remaining <= 0:
                return GenerateResult(traj.traj_id, out_ids, logps, versions, "length")

    def _take_routes(self, traj: Trajectory, req: GenerateRequest, res: GenerateResult, counted: bool) -> None:
        """Keep the engine's route segments in ``traj`` (before its tokens are appended), each with the version
        of the tokens it generated. They cover ``req.prompt_ids`` + the output, which must be the trajectory's
        tokens so far for positions to line up (an agent turn rendered anew is not: its routes are dropped and
        its tokens route live); a segment whose tokens are of several versions describes no one network and is
        dropped the same way."""
        problem = ("the engine returned no MoE routes" if res.routes is None else
                   "its prompt is not the trajectory's tokens so far, so its routes cannot be placed"
                   if req.prompt_ids != traj.tokens else None)
        segments = []
        for seg in res.routes or []:
            first, last = seg.start + 1 - len(req.prompt_ids), seg.end - len(req.prompt_ids)
            owned = set(res.versions[max(first, 0):last + 1])
            if len(owned) != 1:
                problem = problem or f"its tokens {first}..{last} are of versions {sorted(owned)}"
                continue
            seg.version = owned.pop()
            segments.append(seg)
        if problem is None:
            for seg in segments:
                traj.add_route_segment(seg)
            return
        if self.strict_routes:
            raise EngineError(f"request {req.request_id}: {problem}; rollout.routing_replay_strict=true stops here "
                              f"(false routes such tokens live)")
        self.counters["n_routes_missing"] += counted
