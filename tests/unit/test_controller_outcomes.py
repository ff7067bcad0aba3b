"""What the loop does with what comes back: failing generation, failing rewards, all-equal groups.

The controller and replay buffer are the real ones; engine and trainer are the
timing simulators of test_staleness_gate.py (the real ones run this loop in tests/e2e).
"""
import asyncio
import random
import re
from types import SimpleNamespace

import pytest
from test_staleness_gate import SimulatedEngineForGateTests, SingleTurn, StepCounterTrainerForGateTests

from megarl.builder import load_run_config
from megarl.errors import AgentError, InputError, RewardError, TrainingError
from megarl.loop.buffer import PublishedVersion, ReplayBuffer
from megarl.loop.controller import Controller
from recovery.base import RecoveryContext
from recovery.behav import Behav


class RefusingEngine(SimulatedEngineForGateTests):
    async def generate(self, req):
        await asyncio.sleep(0)
        raise InputError(f"request {req.request_id}: prompt too long")


class ScriptedRewards:
    """Reward = ``fn(traj)``; a reward of None is a failed call (as the service reports one)."""

    def __init__(self, fn):
        self.fn = fn

    async def score(self, traj):
        await asyncio.sleep(0)
        r = self.fn(traj)
        if r is None:
            return SimpleNamespace(reward=0.0, failed=True, reason="raise: ValueError: no tests for this row")
        return SimpleNamespace(reward=r, failed=False, reason=None)


def loop(overrides, *, engine=None, rewards=None, steps=4, workflow=None, records=None, skip=(), on_step=None,
         trainer=None, loss_fn_factory=None, **optional):
    rng = random.Random(0)
    cfg = load_run_config(None, ["trainer.batch_size=8", "rollout.group_size=4", "rollout.eta=1", *overrides])
    engine = engine or SimulatedEngineForGateTests(rng, 12)
    trainer = trainer or StepCounterTrainerForGateTests(rng, skip)
    counter = iter(range(10**9))
    prompts = iter(lambda: SimpleNamespace(prompt_id=f"p{next(counter)}", prompt_ids=[1, 5, 2], answer=None,
                                           row={"prompt": "hi"}), None)

    class Publisher:
        async def prepare(self, version):
            pass

        async def apply(self, version):
            engine.version = version

    def advantages(trajs):
        for t in trajs:
            t.advantage = 0.0

    records = [] if records is None else records
    c = Controller(cfg, trainer=trainer, router=engine, buffer=ReplayBuffer(cfg.trainer.batch_size, cfg.rollout.eta),
                   published=PublishedVersion(), rewards=rewards or ScriptedRewards(lambda t: 1.0),
                   dataset=prompts, workflow=workflow or SingleTurn(),
                   strategy=Behav(None, RecoveryContext(trainer=trainer)),
                   publisher=Publisher(), loss_fn_factory=loss_fn_factory or (lambda b, a: None), advantages=advantages,
                   on_step=on_step or records.append, **optional)

    async def main():
        try:
            await asyncio.wait_for(c.train(steps), 60)
        finally:
            if hasattr(c.workflow, "aclose"):  # an agent endpoint listening on this loop
                await c.workflow.aclose()

    asyncio.run(main())
    return c, records


def test_generation_that_always_fails_stops_the_run_instead_of_spinning():
    with pytest.raises(TrainingError, match=r"groups in a row failed in generation; the last with InputError: "
                                            r"request .* prompt too long"):
        loop([], engine=RefusingEngine(random.Random(0), 12))


def test_rewards_failing_on_most_calls_stop_the_run_showing_one_failure():
    with pytest.raises(RewardError, match=r"of \d+ reward calls failed .* reward.max_fail_frac=0.5.*"
                                          r"ValueError: no tests for this row"):
        loop([], rewards=ScriptedRewards(lambda t: None))


def test_reward_failures_are_counted_with_their_calls_and_the_first_step_stops():
    # a call and its failure are counted together: at a step boundary inside a group, counting the group's
    # failures only once the whole group was scored made 12 of 15 (40 of 83 in a real run) look failed and the run
    # went on
    records = []

    class Slow(ScriptedRewards):  # the group's members finish at different times
        async def score(self, traj):
            await asyncio.sleep(0.002 * int(traj.traj_id.rsplit("-", 1)[1]))
            return await super().score(traj)

    with pytest.raises(RewardError, match=r"(\d+) of \1 reward calls failed at step [01] "):
        loop([], rewards=Slow(lambda t: None), records=records)
    assert len(records) <= 1 and all(r["n_reward_failed"] == r["n_reward_calls"] > 0 for r in records)


def test_a_few_failing_rewards_are_tolerated():
    # one trajectory in four fails: 25% <= max_fail_frac
    c, records = loop([], rewards=ScriptedRewards(lambda t: None if t.traj_id.endswith("-0") else 1.0))
    assert len(records) == 4 and sum(r["n_reward_failed"] for r in records) > 0


def test_on_failure_drop_with_every_reward_failing_stops_too():
    # nothing would ever reach a step: the check also runs per batch's worth of calls
    with pytest.raises(RewardError, match="reward calls failed"):
        loop(["reward.on_failure=drop"], rewards=ScriptedRewards(lambda t: None))


def test_filter_groups_drops_all_equal_groups_and_refills():
    # groups of even prompts have equal rewards (no signal); odd ones differ within the group
    def reward(t):
        prompt = int(t.meta["prompt_id"][1:])
        return 1.0 if prompt % 2 == 0 else float(t.traj_id.endswith("-0"))

    c, records = loop(["rollout.filter_groups=true"], rewards=ScriptedRewards(reward))
    assert len(records) == 4
    assert sum(r["n_filtered"] for r in records) > 0 and c.counters["n_filtered"] % 4 == 0
    assert all(r["reward_mean"] == 0.25 for r in records)  # only groups with signal were trained on
    _, unfiltered = loop([], rewards=ScriptedRewards(reward))
    assert sum(r["n_filtered"] for r in unfiltered) == 0 and any(r["reward_mean"] > 0.25 for r in unfiltered)


def agent_workflow(name, tokenizer):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from megarl.agents.client import AgentLimits
    from megarl.types import SamplingParams
    from megarl.workflows.agent import AgentWorkflow, load_agent

    return AgentWorkflow(load_agent(f"agent_fixtures:{name}"), tokenizer, None,
                         AgentLimits(SamplingParams(max_new_tokens=8), max_turns=4, max_tokens=512))


def test_agents_failing_on_most_episodes_stop_the_run(text_tokenizer):
    # each episode's failure alone is counted and the run goes on; a run of them is no silent run of zeros
    with pytest.raises(AgentError, match=r"episodes failed .* agent.fn='agent_fixtures:raises_after_one_turn' "
                                         r".* RuntimeError: the agent broke"):
        loop([], workflow=agent_workflow("raises_after_one_turn", text_tokenizer))


@pytest.mark.parametrize("agent", ["one_in_four_fails", "one_in_four_nan"])
def test_failed_agent_episodes_and_non_finite_agent_rewards_are_failures_that_drop_drops(agent, text_tokenizer):
    # one episode in four fails (raises, or returns NaN / inf): 25% <= reward.max_fail_frac, the run goes on;
    # with reward.on_failure=drop none of them is trained, the others (reward 1) are
    c, records = loop(["reward.on_failure=drop"], workflow=agent_workflow(agent, text_tokenizer))
    assert len(records) == 4
    failed = sum(r["n_reward_failed"] for r in records)
    # dropped when their group completes (groups still running at the end count failures, not drops yet)
    assert failed > 0 and 0 < c.counters["n_dropped"] <= c.counters["n_reward_failed"]
    assert all(r["reward_mean"] == 1.0 for r in records)  # only the episodes that succeeded were trained
    # with reward.on_failure=zero they are trained with reward 0 (a NaN or inf too)
    _, zero = loop([], workflow=agent_workflow(agent, text_tokenizer))
    assert sum(r["n_reward_failed"] for r in zero) > 0 and sum(r["n_dropped"] for r in zero) == 0
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in zero) and any(r["reward_mean"] < 1.0 for r in zero)


class TwoRowEpisodes:
    """Each episode writes two training rows: its own and one part (as an agent's second conversation does)."""

    async def run(self, traj, generate):
        from megarl.types import SamplingParams, Trajectory

        await generate(traj.prompt_ids, SamplingParams(max_new_tokens=4))
        part = Trajectory(traj_id=f"{traj.traj_id}.t1", group_id=traj.group_id, prompt_ids=[1, 7, 2],
                          meta=traj.meta, logp_old=traj.logp_old and [])
        traj.parts.append(part)
        await generate(part.prompt_ids, SamplingParams(max_new_tokens=4), into=part)
        return traj

    def stats(self):
        return {}


def test_a_skipped_step_of_multi_row_episodes_releases_its_episodes_not_its_rows():
    # B = 8 episodes (16 rows) per step; the first step is skipped. The gate counts episodes: releasing the 16
    # rows counted 8 untrained episodes as gone, the gate let 8 more in than eta allows and the batch-forming
    # deadline check then never found a feasible batch (only the stall watchdog ended the run)
    c, records = loop(["rollout.eta=0", "trainer.stall_timeout_s=5"], workflow=TwoRowEpisodes(), skip=(0,))
    trainer, buffer = c.trainer, c.buffer
    assert [r["skipped"] for r in records] == [1.0, 0.0, 0.0, 0.0]
    assert [len(t[2]) for t in trainer.trained] == [16] * 4  # 8 episodes of 2 rows each step
    assert buffer.released_total == 8  # the skipped step's 8 episodes; its 16 rows made the gate stall


def test_a_stall_from_filtering_every_group_names_the_filter_not_the_engines():
    # a constant reward: every group is all-equal and filtered; groups keep finishing, none is kept
    with pytest.raises(TrainingError) as e:
        loop(["rollout.filter_groups=true", "trainer.stall_timeout_s=0.5"], rewards=ScriptedRewards(lambda t: 1.0))
    msg = str(e.value)
    filtered = int(re.search(r"(\d+) samples were filtered", msg).group(1))
    assert filtered > 0 and filtered % 4 == 0  # whole groups of 4
    assert "rollout.filter_groups" in msg and "constant reward" in msg
    assert "the engines or the rewards are stuck" not in msg


class HeldEvaluation:
    """An evaluation workflow whose episodes wait until ``release`` is set: an evaluation longer than eval.every."""

    def __init__(self):
        self.release = asyncio.Event()
        self.running = self.max_running = 0

    async def run(self, traj, generate):
        from megarl.types import SamplingParams

        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        await generate(traj.prompt_ids, SamplingParams(max_new_tokens=2))
        return traj


def test_an_evaluation_longer_than_eval_every_is_never_overlapped_and_the_skipped_ones_are_counted():
    from megarl.data import Prompt
    from megarl.loop.evaluation import Evaluator

    held = HeldEvaluation()
    evaluator = Evaluator([Prompt("e0", [1, 5, 2], None, {"prompt": "hi"})], held, ScriptedRewards(lambda t: 1.0),
                          n_samples=1, pass_threshold=1.0)
    records, evals = [], []

    def on_step(record):
        records.append(record)
        if record["step"] == 5:  # the evaluation started at step 1 ends after step 5
            held.release.set()

    loop(["eval.every=1"], steps=8, on_step=on_step, evaluator=evaluator, on_eval=evals.append)
    assert held.max_running == 1  # one evaluation at a time
    # due at steps 1..7 and at the end; those due while one ran (at least steps 2, 3, 4) were skipped
    assert evals[0]["step"] == 1 and evals[-1]["step"] == 8
    assert evals[-1]["eval/n_skipped"] == 7 - (len(evals) - 1) >= 3
    assert evaluator.n_runs == len(evals)


def test_the_failure_share_is_checked_over_the_last_batch_of_reward_calls_not_one_step_window():
    # a step that happened to see one reward call, a failed one, stopped a run whose rewards failed 1 time in 4
    # ("1 of 1 reward calls failed at step 4"): the share is checked over the last B calls
    c, records = loop([])
    c.bookkeeping.step_counters = dict(c.counters)
    c.counters["n_reward_calls"] += 1
    c.counters["n_reward_failed"] += 1  # this step's window: 1 of 1 failed
    for cause in [None] * 7 + ["reward"]:
        c.failures.add(cause, "trajectory g9-0: raise: ValueError: failed")
    assert c.bookkeeping.failure_error(c.step) is None
    for _ in range(5):  # the last 8: 2 passed, 6 failed: more than max_fail_frac=0.5
        c.failures.add("reward", "trajectory g9-0: raise: ValueError: failed")
    err = c.bookkeeping.failure_error(c.step)
    assert err is not None and str(err).startswith("6 of 8 reward calls failed at step 4")
