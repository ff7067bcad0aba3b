"""Advantage estimators on hand-computed groups."""
import math
import random

import pytest

from megarl.errors import ConfigError
from megarl.losses.advantages import compute_advantages


def approx(xs):
    return pytest.approx(xs, abs=1e-9)


def test_grpo_population_std():
    # r = [0, 1, 2]: mean 1, population std sqrt(2/3) (sample std would be 1)
    s = math.sqrt(2 / 3)
    adv = compute_advantages({"g": [0.0, 1.0, 2.0]}, "grpo", eps=0.0)
    assert adv["g"] == approx([-1 / s, 0.0, 1 / s])


def test_grpo_with_eps():
    # r = [1, 0, 0, 1]: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 1e-4)
    a = 0.5 / (0.5 + 1e-4)
    assert compute_advantages({"g": [1.0, 0.0, 0.0, 1.0]})["g"] == approx([a, -a, -a, a])


def test_grpo_without_std_is_r_minus_mean():
    assert compute_advantages({"g": [0.0, 1.0, 2.0]}, std_normalize=False)["g"] == approx([-1.0, 0.0, 1.0])


def test_loo_hand_computed():
    # r = [0, 1, 2]: baselines (1+2)/2, (0+2)/2, (0+1)/2 -> [-1.5, 0, 1.5]
    adv = compute_advantages({"g": [0.0, 1.0, 2.0]}, "loo", std_normalize=False)
    assert adv["g"] == approx([-1.5, 0.0, 1.5])
    s = math.sqrt(2 / 3)
    normed = compute_advantages({"g": [0.0, 1.0, 2.0]}, "loo", eps=0.0)
    assert normed["g"] == approx([-1.5 / s, 0.0, 1.5 / s])


def test_loo_equals_scaled_grpo():
    rng = random.Random(0)
    r = [rng.random() for _ in range(8)]
    loo = compute_advantages({0: r}, "loo", std_normalize=False)[0]
    centred = compute_advantages({0: r}, "grpo", std_normalize=False)[0]
    assert loo == approx([8 / 7 * c for c in centred])


def test_constant_and_singleton_groups_are_zero():
    adv = compute_advantages({"same": [0.7] * 4, "one": [0.3], "none": []})
    assert adv == {"same": [0.0] * 4, "one": [0.0], "none": []}
    assert compute_advantages({"one": [0.3]}, "loo") == {"one": [0.0]}


def test_groups_are_independent_and_ordered():
    adv = compute_advantages({"a": [1.0, 0.0], "b": [5.0, 7.0]}, std_normalize=False)
    assert list(adv) == ["a", "b"]
    assert adv["a"] == approx([0.5, -0.5]) and adv["b"] == approx([-1.0, 1.0])


def test_bad_input():
    with pytest.raises(ConfigError, match="ppo"):
        compute_advantages({"g": [1.0]}, "ppo")
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages({"g": [1.0, float("nan")]})


def test_pos_weight_scales_only_positive_advantages():
    # rewards 1, 0, 0, 0: mean 0.25, population std sqrt(3)/4; A = (0.75, -0.25 x3) / std
    s = math.sqrt(3) / 4
    adv = compute_advantages({"g": [1.0, 0.0, 0.0, 0.0]}, eps=0.0, pos_weight=0.1)["g"]
    assert adv == approx([0.1 * 0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    # after Dr. GRPO centring too; a zero advantage stays zero
    adv = compute_advantages({"g": [2.0, 1.0, 0.0]}, std_normalize=False, pos_weight=0.5)["g"]
    assert adv == approx([0.5, 0.0, -1.0])
    assert compute_advantages({"g": [1.0, 0.0]}, pos_weight=1.0) == compute_advantages({"g": [1.0, 0.0]})
    with pytest.raises(ConfigError, match="pos_weight"):
        compute_advantages({"g": [1.0, 0.0]}, pos_weight=-0.1)


def test_pos_weight_reaches_the_trajectories_from_the_config():
    from types import SimpleNamespace

    from megarl.config.schema import AdvantageConfig
    from megarl.losses.advantages import advantage_fn

    trajs = [SimpleNamespace(group_id="g", reward=r, advantage=None) for r in (1.0, 0.0)]
    advantage_fn(AdvantageConfig(std_normalize=False, pos_weight=0.1))(trajs)
    assert [t.advantage for t in trajs] == approx([0.05, -0.5])


def test_a_bad_pos_weight_is_refused_before_a_run_starts():
    # inside the loop a group whose advantages fail only has its samples dropped: the config must fail first
    from megarl.config import MegaRLConfig
    from megarl.preflight import validate

    cfg = MegaRLConfig()
    cfg.advantage.pos_weight = -0.1
    with pytest.raises(ConfigError, match=r"advantage.pos_weight=-0.1 must be a finite number >= 0"):
        validate(cfg, {})
