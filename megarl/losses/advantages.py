"""Group-relative advantage estimators (one scalar per trajectory).

- ``grpo`` (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps),
  with the *population* std (divide by n, not n - 1) over the group.
- ``loo`` (RLOO, Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j, the
  leave-one-out baseline; it equals n / (n - 1) * (r_i - mean(r)).

``std_normalize`` applies to both estimators: it divides by (std(r) + eps).
RLOO as published is unnormalized, so pass ``std_normalize=False`` for it;
``grpo`` with ``std_normalize=False`` is Dr. GRPO's r_i - mean(r).

``pos_weight`` scales the positive advantages after both: W-REINFORCE (Zhu et al. 2025, "The
Surprising Effectiveness of Negative Reinforcement in LLM Reasoning") trains mostly on the samples worse
than their group (0.1 there). Pushing a wrong answer down spreads its probability over the other answers in
proportion to their current mass, while pushing a right one up sharpens the distribution, so a small
pos_weight keeps the policy's entropy where plain GRPO drives a group to one answer, right or wrong.

A group of one sample has no baseline: its advantage is 0.0 under both
estimators (it carries no learning signal, as in GRPO with std 0).
"""
from __future__ import annotations

import math
from typing import Hashable

from megarl.errors import ConfigError

ESTIMATORS = ("grpo", "loo")


def _group_advantages(rewards: list[float], estimator: str, std_normalize: bool, eps: float,
                      pos_weight: float = 1.0) -> list[float]:
    n = len(rewards)
    if n <= 1:
        return [0.0] * n
    mean = sum(rewards) / n
    if estimator == "grpo":
        adv = [r - mean for r in rewards]
    else:
        total = sum(rewards)
        adv = [r - (total - r) / (n - 1) for r in rewards]
    if std_normalize:
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        adv = [a / (std + eps) for a in adv]
    if pos_weight != 1.0:
        adv = [a * pos_weight if a > 0 else a for a in adv]
    return adv


def check_pos_weight(pos_weight: float) -> None:
    """ConfigError unless ``advantage.pos_weight`` is a finite number >= 0 (preflight calls it before a run)."""
    if not (math.isfinite(pos_weight) and pos_weight >= 0):
        raise ConfigError(f"advantage.pos_weight={pos_weight} must be a finite number >= 0 (1 = plain "
                          f"advantages, 0.1 = W-REINFORCE)")


def compute_advantages(rewards_by_group: dict[Hashable, list[float]], estimator: str = "grpo",
                       std_normalize: bool = True, eps: float = 1e-4,
                       pos_weight: float = 1.0) -> dict[Hashable, list[float]]:
    """Advantages per group, in the order of the rewards given.

    Raises ConfigError for an unknown estimator and ValueError for a non-finite
    reward (a failed reward must be dropped or zeroed before this point).
    """
    if estimator not in ESTIMATORS:
        raise ConfigError(f"unknown advantage estimator {estimator!r}; choose one of {list(ESTIMATORS)}")
    check_pos_weight(pos_weight)
    out: dict[Hashable, list[float]] = {}
    for gid, rewards in rewards_by_group.items():
        bad = [r for r in rewards if not math.isfinite(r)]
        if bad:
            raise ValueError(f"group {gid!r} has non-finite rewards {bad}")
        out[gid] = _group_advantages([float(r) for r in rewards], estimator, std_normalize, eps, pos_weight)
    return out


def advantage_fn(adv_cfg):
    """``assign(trajs)``: sets ``advantage`` on every trajectory of one group, from its rewards."""
    def assign(trajs):
        gid = trajs[0].group_id
        adv = compute_advantages({gid: [t.reward for t in trajs]}, estimator=adv_cfg.estimator,
                                 std_normalize=adv_cfg.std_normalize, eps=adv_cfg.eps,
                                 pos_weight=adv_cfg.pos_weight)[gid]
        for t, a in zip(trajs, adv):
            t.advantage = float(a)

    return assign
