"""The workflow interface: how one trajectory is rolled out.

A workflow owns the turn structure (one answer, or policy turns interleaved
with tool output); the controller owns everything about engines. It passes
``generate(context_ids, sampling) -> Awaitable[GenerateResult]``, which
handles interruption and resubmission and returns the merged result of one
turn, whose per-token ``versions`` may change mid-result (tokens sampled
before and after a weight update). Policy tokens reach ``traj`` through
:func:`append_turn` (``traj.append_policy``), tool/environment tokens through
``traj.append_tool`` (loss_mask 0, version NO_VERSION); a workflow never edits
the per-token lists itself.

Engines return a stop token (EOS, a tool call) as the last output token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, runtime_checkable

from megarl.types import GenerateResult, Trajectory, append_turn  # noqa: F401 (append_turn is re-exported here)

#: ``generate(context_ids, sampling, into=None)``: one policy turn appended to the trajectory (or to
#: ``into``, another trajectory of the same episode: an agent's part, megarl/agents/client.py)
GenerateFn = Callable[..., Awaitable[GenerateResult]]


@dataclass
class TurnPoint:
    """Where a trajectory's workflow stands: the policy turn ``turn`` (0 = the first) began after ``start``
    response tokens; ``open`` while its generation has not returned (its tokens so far are the response's last
    ``len(response_ids) - start``), False once the turn ended (a multi-turn workflow then waits for the tool)."""

    turn: int = 0
    start: int = 0
    open: bool = True


@runtime_checkable
class Workflow(Protocol):
    """Rolls out ``traj`` (prompt filled in, response empty) and returns it completed.

    A workflow with ``resumable = True`` also takes ``resume``, a :class:`TurnPoint`: ``traj`` was restored from
    a checkpoint mid-episode and goes on from there (megarl/loop/running_groups.py).
    """

    async def run(self, traj: Trajectory, generate: GenerateFn) -> Trajectory: ...

    def stats(self) -> dict[str, int]:
        """Counts since the start (e.g. an agent's tool calls and failures); the loop logs each step's share."""
        ...

    def close(self) -> None:
        """Stop what the workflow started (an agent's tool workers)."""
        ...


@runtime_checkable
class ToolEnv(Protocol):
    """An environment a multi-turn policy calls by emitting ``tool_call_id``."""

    #: the token that ends a policy turn with a call to this environment
    tool_call_id: int

    async def respond(self, traj: Trajectory) -> list[int]:
        """The tokens the environment answers with, given the trajectory so far."""
        ...
