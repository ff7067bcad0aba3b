"""DAPO's soft overlong punishment: values by hand, applied to training rewards only, refused where it has no
meaning."""
import asyncio

import pytest

from megarl.builder import load_run_config as load_config
from megarl.errors import ConfigError
from megarl.preflight import _check_overlong
from megarl.rewards.overlong import OverlongPenalty, overlong_penalty
from megarl.rewards.scorer import TrajectoryScorer
from megarl.rewards.service import RewardOutcome


def test_penalty_by_hand():
    p = OverlongPenalty(max_len=100, buffer=20, penalty=1.0)
    # 0 up to L_max - buffer = 80, then -(L - 80)/20, -1 at 100 (and beyond: a response is never longer)
    assert [p(n) for n in (0, 80, 81, 90, 99, 100, 120)] == [0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0]
    assert OverlongPenalty(max_len=10, buffer=4, penalty=0.5)(9) == pytest.approx(-0.375)
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenalty(max_len=10, buffer=11)


class _Tok:
    def decode_response(self, ids):
        return "x" * len(ids)

    def decode_prompt(self, ids):
        return ""


class _Service:  # the reward service's contract: one outcome per input
    def __init__(self, outcome):
        self.outcome = outcome

    async def score(self, sample):
        return self.outcome


class _Traj:
    def __init__(self, n):
        self.response_ids, self.prompt_ids, self.meta, self.finish_reason = [1] * n, [2], {}, "length"


def test_training_scorer_adds_it_evaluation_does_not_and_a_failed_reward_stays_as_it_is():
    scorer = TrajectoryScorer(_Tok(), _Service(RewardOutcome(reward=1.0)), OverlongPenalty(100, 20))
    assert asyncio.run(scorer.score(_Traj(90))).reward == 0.5
    assert asyncio.run(scorer.score(_Traj(50))).reward == 1.0
    assert asyncio.run(scorer.without_length_penalty().score(_Traj(90))).reward == 1.0
    failed = RewardOutcome(reward=0.0, failed=True, reason="raise: x")
    assert asyncio.run(TrajectoryScorer(_Tok(), _Service(failed), OverlongPenalty(100, 20)).score(_Traj(100))) \
        == failed


def test_config_builds_it_and_the_preflight_refuses_what_it_cannot_mean():
    cfg = load_config("configs/tiny_cpu.yaml", ["reward.overlong_buffer=4", "reward.overlong_penalty=0.5"])
    assert overlong_penalty(cfg) == OverlongPenalty(cfg.rollout.max_new_tokens, 4, 0.5)
    assert overlong_penalty(load_config("configs/tiny_cpu.yaml", [])) is None
    too_long = load_config("configs/tiny_cpu.yaml", [f"reward.overlong_buffer={cfg.rollout.max_new_tokens + 1}"])
    with pytest.raises(ConfigError, match="reward.overlong_buffer"):
        _check_overlong(too_long)
    agent = load_config("configs/tiny_agent_cpu.yaml", ["reward.overlong_buffer=2"])
    with pytest.raises(ConfigError, match="single-turn"):
        _check_overlong(agent)
