"""`megarl generate`: sample continuations of JSONL prompts with an in-process engine.

Each input line ``{"input_ids": [...]}`` gives one output line
``{"output_ids", "logprobs", "versions", "finish_reason"}`` in the same order;
``logprobs`` are logp_behav (the processed distribution sampled from).
Request i uses seed ``--seed + i``, so a run is reproducible.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from megarl.commands._engine_args import add_engine_resource_args, engine_resource_options
from megarl.commands._jsonl_input import read_input_ids
from megarl.rollout.backends import make_engine
from megarl.rollout.base import BACKENDS, resources_note
from megarl.rollout.weight_spec import read_config
from megarl.tokenizer import read_generation_eos
from megarl.types import GenerateRequest, SamplingParams


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate continuations of JSONL prompts (token ids)")
    p.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory")
    p.add_argument("--backend", choices=BACKENDS, default="vllm", help="engine backend")
    p.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} per line')
    p.add_argument("--output", required=True, help="JSONL to write results to")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    p.add_argument("--seed", type=int, default=0, help="request i is sampled with seed + i")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=None,
                   help="token ids that end a generation (default: eos_token_id of config.json and "
                        "generation_config.json)")
    add_engine_resource_args(p)
    p.set_defaults(func=run)


def _default_stop_ids(checkpoint: str) -> list[int]:
    """What a training run stops at: config.json's eos_token_id and every id of generation_config.json."""
    eos = read_config(checkpoint).get("eos_token_id")
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return sorted(set(ids) | set(read_generation_eos(checkpoint)))


async def _generate_all(args, prompts: list[list[int]]) -> list:
    stop = args.stop_token_ids if args.stop_token_ids is not None else _default_stop_ids(args.checkpoint)
    engine = await make_engine(args.backend, args.checkpoint, seed=args.seed, **engine_resource_options(args))
    try:
        reqs = [GenerateRequest(f"gen-{i}", ids, SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
            stop_token_ids=stop, seed=args.seed + i)) for i, ids in enumerate(prompts)]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        return results, resources_note(await engine.health())
    finally:
        await engine.close()


def run(args) -> int:
    prompts = read_input_ids(args.input)
    t0 = time.perf_counter()
    results, resources = asyncio.run(_generate_all(args, prompts))
    with open(args.output, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({"output_ids": r.output_ids, "logprobs": r.logp_behav, "versions": r.versions,
                                "finish_reason": r.finish_reason}) + "\n")
    n_tokens = sum(len(r.output_ids) for r in results)
    print(f"wrote {len(results)} results ({n_tokens} tokens) to {args.output} in {time.perf_counter() - t0:.1f} s "
          f"({args.backend}{resources})", file=sys.stderr)
    return 0
