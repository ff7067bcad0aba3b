"""One prompt, one generated answer."""
from __future__ import annotations

from megarl.types import SamplingParams, Trajectory
from megarl.workflows.base import GenerateFn, TurnPoint, append_turn


class SingleTurnWorkflow:
    """One ``generate`` call on the prompt; every response token is a policy token."""

    #: continues an answer a restart cut (``resume``: megarl/loop/running_groups.py)
    resumable = True

    def __init__(self, sampling: SamplingParams) -> None:
        self.sampling = sampling

    async def run(self, traj: Trajectory, generate: GenerateFn, resume: TurnPoint | None = None) -> Trajectory:
        """``resume``: where a checkpoint cut the answer; its tokens so far are ``traj``'s response, and the
        controller's ``generate`` goes on from them."""
        if resume is not None and not resume.open:  # the answer had ended: nothing is left to generate
            return traj
        n_before = len(traj.response_ids) if resume is None else resume.start
        result = await generate(list(traj.prompt_ids), self.sampling)
        append_turn(traj, n_before, result)
        traj.finish_reason = result.finish_reason
        return traj

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass  # holds nothing that needs stopping
