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

from typing import Awaitable, Callable, Protocol, runtime_checkable

from megarl.types import GenerateResult, Trajectory

#: ``generate(context_ids, sampling, into=None)``: one policy turn appended to the trajectory (or to
#: ``into``, another trajectory of the same episode: an agent's part, megarl/agents/client.py)
GenerateFn = Callable[..., Awaitable[GenerateResult]]


@runtime_checkable
class Workflow(Protocol):
    """Rolls out ``traj`` (prompt filled in, response empty) and returns it completed."""

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


def append_turn(traj: Trajectory, n_before: int, result: GenerateResult) -> None:
    """Record one policy turn that started when ``traj`` had ``n_before`` response tokens.

    A ``generate`` may already have appended the turn's tokens itself (the
    controller does, chunk by chunk, so recovery hooks see partial segments of
    an interrupted turn); then they are checked, not appended twice.
    """
    n_new = len(traj.response_ids) - n_before
    if n_new == 0:
        traj.append_policy(result.output_ids, result.logp_behav, result.versions)
    elif (traj.response_ids[n_before:] != result.output_ids
          or traj.versions[n_before:] != result.versions):
        raise RuntimeError(f"trajectory {traj.traj_id}: generate appended {n_new} tokens that differ from "
                           f"the {len(result.output_ids)} it returned")
