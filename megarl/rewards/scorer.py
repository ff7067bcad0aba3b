"""From a finished trajectory to its reward: decode with the run's tokenizer, score in the reward service.

The one path every reward of a run takes (training, evaluation, ``megarl
verify-recovery``, the bench): the response is decoded with special tokens
skipped, the prompt as the model saw it, and the row's ground truth and fields
come from the trajectory's ``meta`` (``answer``, ``row``), which the
controller fills from the dataset (megarl/data.py). A training scorer may add a
length penalty to every reward that did not fail (megarl/rewards/overlong.py);
evaluation's scorer has none.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from megarl.rewards.service import RewardOutcome
from megarl.types import RewardInput, Trajectory


class TrajectoryScorer:
    """``await score(traj)``: the reward of one trajectory (never raises for a failing reward function)."""

    def __init__(self, tokenizer: Any, service: Any, length_penalty: Callable[[int], float] | None = None) -> None:
        self.tokenizer = tokenizer
        self.service = service
        self.length_penalty = length_penalty  # response tokens -> reward added (<= 0); None: no penalty

    def without_length_penalty(self) -> "TrajectoryScorer":
        return TrajectoryScorer(self.tokenizer, self.service)

    def reward_input(self, traj: Trajectory) -> RewardInput:
        # an agent's episode is scored on its final assistant message, not on the whole conversation
        final = traj.meta.get("final_response")
        return RewardInput(response=final if final is not None else self.tokenizer.decode_response(traj.response_ids),
                           answer=traj.meta.get("answer"),
                           prompt=self.tokenizer.decode_prompt(traj.prompt_ids),
                           row=traj.meta.get("row") or {}, finish_reason=traj.finish_reason,
                           response_ids=list(traj.response_ids), prompt_ids=list(traj.prompt_ids))

    async def score(self, traj: Trajectory) -> RewardOutcome:
        out = await self.service.score(self.reward_input(traj))
        if self.length_penalty is None or out.failed:
            return out
        return replace(out, reward=out.reward + self.length_penalty(len(traj.response_ids)))
