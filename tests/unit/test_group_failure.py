"""A group whose trajectory fails is dropped at once: its siblings stop generating, calling tools and scoring.

The loop and buffer are the real ones with tests/unit/test_controller_outcomes.py's simulated engine and
trainer; a workflow fails the first trajectory of every fourth group.
"""
import asyncio

from test_controller_outcomes import ScriptedRewards, loop
from test_staleness_gate import SingleTurn

from megarl.errors import InputError


class FailingFirstOfOddGroups(SingleTurn):
    """Trajectory 0 of groups g1, g5, g9, ... fails soon after it starts; every other trajectory takes longer."""

    def __init__(self):
        self.steps = []  # (traj_id, what) in the order they happened

    async def run(self, traj, generate):
        group = int(traj.group_id.rsplit("g", 1)[1])
        if group % 4 == 1 and traj.traj_id.endswith("-0"):
            await asyncio.sleep(0.005)
            raise InputError(f"{traj.traj_id}: prompt too long")
        await asyncio.sleep(0.02)
        self.steps.append((traj.traj_id, "tool call"))
        return await super().run(traj, generate)


def test_the_siblings_of_a_failed_trajectory_are_cancelled():
    workflow = FailingFirstOfOddGroups()
    scored = []

    def reward(t):
        scored.append(t.traj_id)
        return 1.0

    c, records = loop(["trainer.batch_size=16"], workflow=workflow, rewards=ScriptedRewards(reward))
    assert len(records) == 4
    failed_groups = {f"g{k}" for k in range(1, c.group_counter, 4)}
    assert len(failed_groups) >= 4
    siblings_work = [(i, what) for i, what in workflow.steps if i.split("-")[0] in failed_groups]
    siblings_scored = [i for i in scored if i.split("-")[0] in failed_groups]
    assert siblings_work == [] and siblings_scored == [], "a failed group's siblings went on"
