"""Reward functions the reward-service tests address by dotted path.

test_rewards.py puts this directory on sys.path; RewardService hands its
sys.path to the spawned workers, so they import ``reward_fixtures`` too.
"""
from __future__ import annotations

import os
import time


def misbehave(response_ids: list[int], meta: dict) -> float:
    """Behaves as ``meta["mode"]`` says: ok (reward = len(response)), raise, hang, alloc, exit."""
    mode = meta["mode"]
    if mode == "raise":
        raise RuntimeError("reward fixture raised on purpose")
    if mode == "hang":
        time.sleep(100)
    if mode == "alloc":
        block = bytearray(2 << 30)  # 2 GiB, far over the test's 256 MB budget
        return float(len(block))
    if mode == "exit":
        os._exit(7)
    return float(len(response_ids))


def upper_decode(response_ids: list[int]) -> str:
    """A stand-in detokenizer: ids -> their decimal digits."""
    return "".join(str(t % 10) for t in response_ids)


def text_length(response_ids: list[int], meta: dict) -> float:
    return float(len(meta["response_text"]))
