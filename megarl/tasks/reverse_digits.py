"""Reverse a digit string with a long-tailed length: a task a tiny model learns with RL on 2 CPU cores.

Vocab 16: PAD=0, BOS=1, SEP=2, EOS=3, digits 0-9 = tokens 4-13.
Prompt ``BOS d1..dn SEP``; the answer is the digits reversed, then EOS.
n = 1 + floor(Exp(mean 3)), redrawn until n <= 16, so a few prompts are long
and answer lengths are uneven (what makes asynchronous rollout matter).

Reward on the policy's response (``out`` = tokens before the first EOS,
``tgt`` = the reversed digits without EOS)::

    pos = #{i: out[i] == tgt[i]} / max(|out|, |tgt|)
    len = 0 if there is no EOS else max(0, 1 - abs(|out| - |tgt|) / |tgt|)
    r   = 0.75 * pos + 0.25 * len

``len`` keeps the length distribution honest: rewarding ``pos`` alone learns
faster but collapses output lengths into buckets.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

VOCAB_SIZE = 16
PAD, BOS, SEP, EOS = 0, 1, 2, 3
DIGIT0 = 4  # token of digit d is DIGIT0 + d
MAX_DIGITS = 16
MEAN_EXTRA_DIGITS = 3.0
MAX_PROMPT_LEN = MAX_DIGITS + 2  # BOS + digits + SEP
STOP_TOKEN_IDS = (EOS,)


def digit_token(d: int) -> int:
    return DIGIT0 + d


def is_digit_token(tok: int) -> bool:
    return DIGIT0 <= tok < DIGIT0 + 10


def sample_length(rng: random.Random) -> int:
    """n = 1 + floor(Exp(mean 3)), redrawn until n <= 16 (mean ~3.5)."""
    while True:
        n = 1 + math.floor(rng.expovariate(1.0 / MEAN_EXTRA_DIGITS))
        if n <= MAX_DIGITS:
            return n


def make_prompt(rng: random.Random) -> tuple[list[int], dict[str, Any]]:
    """One prompt ``BOS d1..dn SEP`` and its meta ``{"target": reversed digit tokens}``.

    ``meta["target"]`` holds the digit tokens of the answer without the EOS.
    """
    n = sample_length(rng)
    digits = [digit_token(rng.randrange(10)) for _ in range(n)]
    return [BOS, *digits, SEP], {"target": digits[::-1]}


def prompt_rng(seed: int, index: int) -> random.Random:
    """RNG of prompt ``index`` in stream ``seed``: each prompt is reproducible on its own,
    so a resumed stream needs only the index, not an RNG state."""
    return random.Random(f"reverse_digits/{seed}/{index}")


def reward(response_ids: list[int], meta: dict[str, Any]) -> float:
    """r = 0.75*pos + 0.25*len (module docstring); in [0, 1], 1.0 only for the exact answer."""
    tgt = list(meta["target"])
    if not tgt:
        raise ValueError("reverse_digits meta['target'] is empty")
    has_eos = EOS in response_ids
    out = response_ids[: response_ids.index(EOS)] if has_eos else list(response_ids)
    pos = sum(o == t for o, t in zip(out, tgt)) / max(len(out), len(tgt))
    length = max(0.0, 1.0 - abs(len(out) - len(tgt)) / len(tgt)) if has_eos else 0.0
    return 0.75 * pos + 0.25 * length


def write_jsonl(path: str | Path, n: int, seed: int) -> None:
    """Write ``n`` prompts as JSONL lines ``{"id", "prompt_ids", "meta"}`` (PromptDataset's format)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            prompt_ids, meta = make_prompt(prompt_rng(seed, i))
            f.write(json.dumps({"id": f"reverse_digits/{seed}/{i}", "prompt_ids": prompt_ids, "meta": meta}) + "\n")
