"""Running the trajectories of one group together: the first failure cancels the others.

A group is trained only whole (its advantages are relative to its members), so
once one of its trajectories fails, the others' generation, tool calls and
reward calls are wasted work that also holds engine slots and tool workers:
:func:`gather_or_cancel` stops them at once, where ``asyncio.gather`` would let
them run to their end.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """The results of ``aws`` in order; on the first failure the others are cancelled, and once they have
    stopped, that failure is raised. Cancelling the caller cancels them all."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:  # let them unwind (release engine slots, close tool calls) before the caller goes on
            await asyncio.wait(pending)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]
