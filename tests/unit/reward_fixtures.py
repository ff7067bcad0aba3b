"""Reward functions the reward-service tests address by dotted path.

test_rewards.py puts this directory on sys.path; RewardService hands its
sys.path to the spawned workers, so they import ``reward_fixtures`` too.
"""
from __future__ import annotations

import os
import time


def misbehave(response: str, answer: str) -> float:
    """Behaves as ``answer`` says: ok (reward = len(response)), raise, hang, alloc, exit."""
    if answer == "raise":
        raise RuntimeError("reward fixture raised on purpose")
    if answer == "hang":
        time.sleep(100)
    if answer == "alloc":
        block = bytearray(2 << 30)  # 2 GiB, far over the test's 256 MB budget
        return float(len(block))
    if answer == "exit":
        os._exit(7)
    return float(len(response))


def echo_info(response: str, answer, **info) -> float:
    """Takes every info key; the reward encodes what it saw so the test can check it crossed the process."""
    assert info["row"] == {"level": 3} and info["finish_reason"] == "length"
    assert info["prompt"] == "P" and info["response_ids"] == [1, 2] and info["prompt_ids"] == [9]
    return 7.0


def only_prompt(response: str, answer, prompt: str) -> float:
    """Takes one info key by name; the others are not passed."""
    return float(len(prompt))


def no_answer(response: str) -> float:
    return 0.0
