"""The reward path of `megarl train`: trajectory ids -> the run's tokenizer -> reward service -> reward.

The controller scores every finished trajectory with ``TrajectoryScorer.score``
(megarl/loop/controller.py); these tests drive that same object with a real HF
tokenizer and real reward workers.
"""
import asyncio

import pytest

from megarl.rewards.scorer import TrajectoryScorer
from megarl.rewards.service import RewardService
from megarl.types import Trajectory


def trajectory(tok, prompt: str, response: str, answer, finish="stop", row=None) -> Trajectory:
    prompt_ids = tok.encode_rendered([tok.render(prompt)])[0]
    eos = tok.hf.eos_token_id
    t = Trajectory("t0", "g0", prompt_ids, meta={"answer": answer, "row": row or {}})
    ids = tok.hf.encode(response, add_special_tokens=False) + ([eos] if finish == "stop" else [])
    t.append_policy(ids, [0.0] * len(ids), [0] * len(ids))
    t.finish_reason = finish
    return t


@pytest.mark.parametrize("response, expected", [
    ("17 + 5 = 22, so the answer is \\boxed{22}.", 1.0),
    ("The answer is 22", 1.0),
    ("The answer is \\boxed{23}.", 0.0),
    ("}{\\frac{", 0.0),
])
def test_math_reward_on_decoded_text(text_tokenizer, response, expected):
    traj = trajectory(text_tokenizer, "What is 17 + 5? Put the answer in \\boxed{}.", response, "22")
    with RewardService("math", n_workers=1) as service:
        scorer = TrajectoryScorer(text_tokenizer, service)
        inp = scorer.reward_input(traj)
        out = asyncio.run(scorer.score(traj))
    assert inp.response == response  # EOS skipped, nothing else lost
    assert inp.prompt.startswith("<|im_start|>user\nWhat is 17 + 5?")
    assert (out.reward, out.failed) == (expected, False), out.reason


def test_reverse_digits_sees_the_finish_reason(demo_tokenizer):
    with RewardService("reverse_digits", n_workers=1) as service:
        scorer = TrajectoryScorer(demo_tokenizer, service)
        stopped = asyncio.run(scorer.score(trajectory(demo_tokenizer, "123", "321", "321")))
        cut = asyncio.run(scorer.score(trajectory(demo_tokenizer, "123", "321", "321", finish="length")))
    assert stopped.reward == 1.0 and cut.reward == 0.75
