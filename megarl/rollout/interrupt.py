"""Interruptible rollout: continue an aborted request after a weight update.

A weight update aborts in-flight requests; each returns its partial output
(``finish_reason`` "abort"). Resubmitting prompt + partial makes the engine
recompute the KV cache of the whole prefix with the *new* weights and
continue; the tokens of each piece carry the version that sampled them, so
the joined result is a trajectory spliced from >= 2 versions::

    prompt | v0 v0 v0 (abort) | v1 v1 v1 ... stop
"""
from __future__ import annotations

from dataclasses import replace
from typing import Awaitable, Callable

from megarl.types import GenerateRequest, GenerateResult


def continuation_request(req: GenerateRequest, produced: list[int], attempt: int) -> GenerateRequest:
    """``req`` continued after ``produced`` tokens: prompt + produced, the token budget reduced.

    A per-request seed is shifted per attempt so the continuation does not
    replay the random stream the first attempt started with.
    """
    s = req.sampling
    sampling = replace(s, max_new_tokens=max(s.max_new_tokens - len(produced), 0),
                       stop_token_ids=list(s.stop_token_ids),
                       seed=None if s.seed is None else s.seed + attempt)
    return GenerateRequest(req.request_id, list(req.prompt_ids) + list(produced), sampling)


async def generate_resumable(engine, req: GenerateRequest, *,
                             on_abort: Callable[[GenerateResult], Awaitable[bool]] | None = None,
                             max_interrupts: int = 16) -> tuple[GenerateResult, int]:
    """Generate, resubmitting prompt + partial after every abort; returns (joined result, interrupts).

    ``on_abort(partial_so_far)`` decides whether to continue (default: yes at
    once; an engine that is updating holds the resubmitted request until it
    resumes, so it runs with the new weights). After ``max_interrupts`` or a
    False from ``on_abort`` the partial result is returned with "abort".
    """
    ids: list[int] = []
    logps: list[float] = []
    versions: list[int] = []
    interrupts = 0
    while True:
        res = await engine.generate(continuation_request(req, ids, interrupts))
        ids += res.output_ids
        logps += res.logp_behav
        versions += res.versions
        joined = GenerateResult(req.request_id, list(ids), list(logps), list(versions), res.finish_reason)
        if res.finish_reason != "abort":
            return joined, interrupts
        if len(ids) >= req.sampling.max_new_tokens:
            return replace(joined, finish_reason="length"), interrupts
        interrupts += 1
        if interrupts > max_interrupts or (on_abort is not None and not await on_abort(joined)):
            return joined, interrupts
