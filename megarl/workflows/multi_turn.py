"""Policy turns interleaved with tool-environment responses.

Each policy turn generates from the whole context so far (prompt, earlier
turns, tool output). A turn that stops on the environment's tool-call token
gets the environment's answer appended as tool tokens (never trained on), and
the policy goes on, for at most ``max_turns`` policy turns. A last turn that
still ends in a call gets no answer: nobody would read it.

``max_response_len`` (default: ``sampling.max_new_tokens``) bounds the whole
response, tool tokens included, since it all has to fit the trainer's
sequence length; each turn asks for at most what is left, and a tool answer
that would not fit ends the response (finish_reason ``length``) unanswered.
"""
from __future__ import annotations

from dataclasses import replace

from megarl.types import SamplingParams, Trajectory
from megarl.workflows.base import GenerateFn, ToolEnv, TurnPoint, append_turn


class MultiTurnWorkflow:
    #: continues an episode a restart cut, in its turn (``resume``: megarl/loop/running_groups.py)
    resumable = True

    def __init__(self, sampling: SamplingParams, env: ToolEnv, max_turns: int = 4,
                 max_response_len: int | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.sampling = sampling
        self.env = env
        self.max_turns = max_turns
        self.max_response_len = max_response_len or sampling.max_new_tokens

    async def run(self, traj: Trajectory, generate: GenerateFn, resume: TurnPoint | None = None) -> Trajectory:
        """``resume``: where a checkpoint cut the episode (megarl/loop/running_groups.py): in turn ``resume.turn``,
        whose tokens so far the controller's ``generate`` goes on from, or after it ended with a call whose
        answer had not come (the environment is asked again)."""
        call = self.env.tool_call_id
        stop_ids = sorted(set(self.sampling.stop_token_ids) | {call})
        turn = 0 if resume is None else resume.turn
        answer_first = resume is not None and not resume.open
        while turn < self.max_turns:
            if not answer_first:
                n_before = resume.start if resume is not None and turn == resume.turn else len(traj.response_ids)
                remaining = self.max_response_len - n_before
                if remaining <= 0:
                    traj.finish_reason = "length"
                    break
                sampling = replace(self.sampling, max_new_tokens=remaining, stop_token_ids=stop_ids)
                result = await generate(traj.tokens[:len(traj.prompt_ids) + n_before], sampling)
                append_turn(traj, n_before, result)
                traj.finish_reason = result.finish_reason
                called = result.finish_reason == "stop" and bool(result.output_ids) and result.output_ids[-1] == call
                if not called or turn == self.max_turns - 1:
                    break
            answer_first = False
            answer = await self.env.respond(traj)
            if len(traj.response_ids) + len(answer) > self.max_response_len:  # it would not fit: the turn ends
                traj.finish_reason = "length"
                break
            traj.append_tool(answer)
            turn += 1
        return traj

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass  # holds nothing that needs stopping
