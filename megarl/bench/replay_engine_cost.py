"""What routing replay costs the engines: the time of capturing routes, and the prefix cache it gives up.

``megarl bench`` with ``rollout.routing_replay=true`` sends the run's engines (the bench's pooled engines,
reset to the base checkpoint) a group workload twice per round, without and with ``return_routes``: as
many prompts as the run has groups per batch (``trainer.batch_size / rollout.group_size``), each sampled
``rollout.group_size`` times, of random tokens as long as ``data.max_prompt_len`` allows, answers of
``rollout.max_new_tokens`` at fixed seeds. The first round is warm-up; the ratio of the mean batch times is
capture's share of generation. Prompt tokens prefilled (a prompt's length less what the engine read from
its prefix cache, ``GenerateResult.n_cached_tokens``) count the reuse capture gives up: on CPU megarl's
capture computes every position of a request that asks (a cached position would have no route,
megarl/rollout/vllm_routes.py); vLLM's native output on GPU keeps routed experts per KV-cache block and
reads them with the block, so prefix-cache hits stay. Without capture a group's samples share their
prompt's cached blocks, where a block is full (vLLM's CPU block is 128 tokens: shorter prompts are never
cached, so nothing is given up there).
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from megarl.types import GenerateRequest, SamplingParams

#: timed rounds after the warm-up round
DEFAULT_ROUNDS = 3


def _workload(cfg, vocab: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    n_prompts = max(1, cfg.trainer.batch_size // cfg.rollout.group_size)
    return [[rng.randrange(1, vocab) for _ in range(max_len)] for _ in range(n_prompts)]


async def measure(engine, cfg, vocab: int, max_positions: int, rounds: int = DEFAULT_ROUNDS) -> dict[str, Any]:
    """Time the group workload on ``engine`` (an Engine) without and with captured routes (module doc)."""
    max_new = cfg.rollout.max_new_tokens
    prompt_len = max(1, min(cfg.data.max_prompt_len, max_positions - max_new))
    prompts = _workload(cfg, vocab, prompt_len, cfg.trainer.seed)
    group = cfg.rollout.group_size
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    prefilled: dict[str, list[int]] = {"plain": [], "capture": []}
    for r in range(rounds + 1):  # alternating, so a slower or faster machine moment hits both kinds
        for kind in ("plain", "capture"):
            reqs = [GenerateRequest(f"replay-cost-{kind}-{r}-{p}-{g}", prompt,
                                    SamplingParams(max_new_tokens=max_new, seed=1000 * p + g),
                                    return_routes=kind == "capture")
                    for p, prompt in enumerate(prompts) for g in range(group)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(q) for q in reqs))
            times[kind].append(time.perf_counter() - t0)
            prefilled[kind].append(sum(len(q.prompt_ids) - res.n_cached_tokens for q, res in zip(reqs, results)))
    mean = {k: sum(v[1:]) / rounds for k, v in times.items()}
    per_group = {k: sum(v[1:]) / rounds / len(prompts) for k, v in prefilled.items()}
    return {"engine_prompts": len(prompts), "engine_group_size": group, "engine_prompt_len": prompt_len,
            "engine_max_new_tokens": max_new, "engine_rounds": rounds,
            "engine_batch_s_plain": mean["plain"], "engine_batch_s_capture": mean["capture"],
            "engine_capture_ratio": mean["capture"] / mean["plain"],
            "prompt_tokens_prefilled_per_group_plain": per_group["plain"],
            "prompt_tokens_prefilled_per_group_capture": per_group["capture"]}


def summary_line(cost: dict[str, Any]) -> str:
    return (f"engines: a batch of {cost['engine_prompts']} prompts x {cost['engine_group_size']} samples "
            f"({cost['engine_prompt_len']} + {cost['engine_max_new_tokens']} tokens) took "
            f"{cost['engine_batch_s_plain']:.3f} s, {cost['engine_batch_s_capture']:.3f} s capturing routes: "
            f"x{cost['engine_capture_ratio']:.3f}; prompt tokens prefilled per group "
            f"{cost['prompt_tokens_prefilled_per_group_plain']:.0f} without capture, "
            f"{cost['prompt_tokens_prefilled_per_group_capture']:.0f} with it")
