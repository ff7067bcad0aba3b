"""Evaluation: the pass@k estimator by hand, and one evaluation over a real tokenizer and reward service."""
import asyncio
import math

import pytest
from conftest import DEMO, chat_prompt, digits

from megarl.data import Prompt
from megarl.loop.evaluation import Evaluator, pass_at_k
from megarl.rewards.scorer import TrajectoryScorer
from megarl.rewards.service import RewardService
from megarl.types import GenerateResult, SamplingParams
from megarl.workflows import SingleTurnWorkflow


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 4, 4, 1.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0),
    (4, 1, 2, 1 - math.comb(3, 2) / math.comb(4, 2)),  # 1 - 3/6 = 0.5
    (5, 2, 3, 1 - math.comb(3, 3) / math.comb(5, 3)),  # 1 - 1/10
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_an_evaluation_scores_decoded_text(demo_tokenizer):
    # prompt "12" (answer "21"): samples 0 and 1 answer right, 2 and 3 wrong; prompt "3": all wrong
    answers = {("12", 0): "21", ("12", 1): "21", ("12", 2): "2", ("12", 3): "9", ("3", 0): "4", ("3", 1): "4",
               ("3", 2): "4", ("3", 3): "4"}

    def generate_for(traj):
        prompt, j = traj.meta["row"]["text"], int(traj.traj_id.rsplit("-", 1)[1])

        async def generate(context, sampling):
            out = digits(answers[(prompt, j)]) + [DEMO.IM_END]
            return GenerateResult("r", out, [-0.5] * len(out), [7] * len(out), "stop")
        return generate

    prompts = [Prompt("a", chat_prompt("12"), "21", {"text": "12"}), Prompt("b", chat_prompt("3"), "3", {"text": "3"})]
    workflow = SingleTurnWorkflow(SamplingParams(max_new_tokens=8, stop_token_ids=demo_tokenizer.stop_token_ids))
    with RewardService("reverse_digits", n_workers=1) as service:
        ev = Evaluator(prompts, workflow, TrajectoryScorer(demo_tokenizer, service), n_samples=4, pass_threshold=1.0)
        m = asyncio.run(ev.run(generate_for))
    # rewards: "21"->1, "21"->1, "2"->0.75*1/2+0.25*(1-1/2)=0.5, "9"->0.25*0.5=0.125; "4" vs "3" -> 0.25 each
    assert m["eval/reward_mean"] == pytest.approx((1 + 1 + 0.5 + 0.125 + 4 * 0.25) / 8)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert m["eval/pass@k"] == pytest.approx((1 + 0) / 2) and m["eval/k"] == 4
    assert (m["eval/version_min"], m["eval/version_max"], m["eval/n_reward_failed"]) == (7, 7, 0)


def test_an_agent_episode_keeps_the_reward_its_agent_gave():
    # sample 0 of each prompt: the agent returned 0.75; sample 1: the agent failed (reward 0, agent_error);
    # sample 2: the agent returned None, so the scorer (always 1.0) scores it; sample 3: the agent returned NaN
    # (counts 0, failed)
    from types import SimpleNamespace

    class Agentish:
        async def run(self, traj, generate):
            await generate(traj.prompt_ids, SamplingParams(max_new_tokens=2))
            j = int(traj.traj_id.rsplit("-", 1)[1])
            if j == 0:
                traj.reward = 0.75
            elif j == 1:
                traj.reward, traj.meta["agent_error"] = 0.0, "RuntimeError: the agent broke"
            elif j == 3:
                traj.reward = math.nan
            return traj

    class AlwaysOne:
        async def score(self, traj):
            return SimpleNamespace(reward=1.0, failed=False, reason=None)

    def generate_for(traj):
        async def generate(context, sampling):
            return GenerateResult("r", [5, 6], [-0.5, -0.5], [3, 3], "stop")
        return generate

    prompts = [Prompt("a", [1, 2], "x", {}), Prompt("b", [1, 3], "y", {})]
    ev = Evaluator(prompts, Agentish(), AlwaysOne(), n_samples=4, pass_threshold=1.0)
    m = asyncio.run(ev.run(generate_for))
    assert m["eval/reward_mean"] == pytest.approx((0.75 + 0.0 + 1.0 + 0.0) / 4)
    assert m["eval/pass@1"] == pytest.approx(1 / 4) and m["eval/n_reward_failed"] == 4


def test_a_failing_sample_stops_its_siblings_and_the_other_groups():
    # prompt "a", sample 0 fails at its 3rd generate call; every other sample keeps generating until cancelled.
    # Once the evaluation has raised, no sample may call generate again (they would hold engine slots).
    calls, cancelled = [], set()

    class Looping:
        async def run(self, traj, generate):
            try:
                for n in range(1, 1000):
                    await generate(traj.prompt_ids, SamplingParams(max_new_tokens=2))
                    if traj.traj_id.endswith("a-0") and n == 3:
                        raise RuntimeError("sample a-0 broke")
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                cancelled.add(traj.traj_id)
                raise

    def generate_for(traj):
        async def generate(context, sampling):
            calls.append(traj.traj_id)
            return GenerateResult("r", [5], [-0.5], [3], "stop")
        return generate

    prompts = [Prompt("a", [1, 2], "x", {}), Prompt("b", [1, 3], "y", {})]
    ev = Evaluator(prompts, Looping(), scorer=None, n_samples=3, pass_threshold=1.0)

    async def main():
        with pytest.raises(RuntimeError, match="sample a-0 broke"):
            await ev.run(generate_for)
        n_calls = len(calls)
        for _ in range(20):
            await asyncio.sleep(0)
        return n_calls

    n_calls = asyncio.run(main())
    assert len(calls) == n_calls, f"{len(calls) - n_calls} generate calls after the evaluation failed"
    assert cancelled == {"eval0.a-1", "eval0.a-2", "eval0.b-0", "eval0.b-1", "eval0.b-2"}
    assert calls.count("eval0.a-0") == 3


def test_an_agent_writing_into_a_part_of_its_episode_generates_into_that_part_in_evaluation():
    # an agent's client calls generate(context, sampling, into=row) (as in training); evaluation must accept it
    from megarl.loop.evaluation import EvaluationSchedule
    from megarl.types import Trajectory

    class Generation:
        def __init__(self):
            self.calls = []

        def generate(self, traj, ctx, sp, counted=True):
            self.calls.append((traj.traj_id, counted))
            return traj.traj_id

    schedule = EvaluationSchedule(None, None, None, generation=Generation(), publish=None, trainer=None,
                                  published=None)
    episode, part = Trajectory(traj_id="e", group_id="g", prompt_ids=[1]), Trajectory(traj_id="e.t2", group_id="g",
                                                                                        prompt_ids=[1])
    generate = schedule.generate_for_eval(episode)
    assert generate([1], SamplingParams()) == "e" and generate([1], SamplingParams(), into=part) == "e.t2"
    assert schedule.generation.calls == [("e", False), ("e.t2", False)]
