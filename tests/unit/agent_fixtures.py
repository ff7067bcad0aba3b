"""Agents and tools the agent tests name by dotted path (test_agents.py puts this directory on sys.path,
and worker processes inherit it)."""
from __future__ import annotations

import time


def add(a: int, b: int = 0) -> str:
    """Add two integers.

    Returns their sum as text.
    """
    return str(a + b)


def untyped(x) -> str:
    return str(x)


def hang() -> str:
    """Never returns."""
    time.sleep(1000)
    return ""


def hog() -> str:
    """Allocates far more than its budget."""
    return str(len(bytearray(4 << 30)))


def not_async(client, row):
    return 0.0


async def no_row(client):
    return 0.0


async def scripted(client, row) -> float | None:
    """Three turns, each followed by a tool result, whatever the model says (a fixed control flow); each
    turn's length limit is the run's rollout.max_new_tokens."""
    messages = [{"role": "user", "content": str(row.get("prompt", "go"))}]
    for turn in range(3):
        reply = await client.chat.completions.create(messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        messages.append({"role": "tool", "content": f"result {turn}"})
    return None


async def raises_after_one_turn(client, row) -> float | None:
    await client.chat.completions.create(messages=[{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the agent broke")


_episodes = {"n": 0}


async def one_in_four_fails(client, row) -> float | None:
    """Every fourth episode (in the order they finish their turn) raises; the others return 1."""
    await client.chat.completions.create(messages=[{"role": "user", "content": row["prompt"]}])
    _episodes["n"] += 1
    if _episodes["n"] % 4 == 0:
        raise RuntimeError("the agent broke")
    return 1.0


async def one_in_four_nan(client, row) -> float | None:
    """Every fourth episode returns NaN or inf as its reward; the others return 1."""
    await client.chat.completions.create(messages=[{"role": "user", "content": row["prompt"]}])
    _episodes["n"] += 1
    if _episodes["n"] % 4 == 0:
        return float("nan") if _episodes["n"] % 8 else float("inf")
    return 1.0
