"""One prompt, one generated answer."""
from __future__ import annotations

from megarl.types import SamplingParams, Trajectory
from megarl.workflows.base import GenerateFn, append_turn


class SingleTurnWorkflow:
    """One ``generate`` call on the prompt; every response token is a policy token."""

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling

    async def run(self, traj: Trajectory, generate: GenerateFn) -> Trajectory:
        n_before = len(traj.response_ids)
        result = await generate(list(traj.prompt_ids), self.sampling)
        append_turn(traj, n_before, result)
        traj.finish_reason = result.finish_reason
        return traj

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass  # holds nothing that needs stopping
