"""The engine's publish stall in a quick local loop: ``python -m megarl.bench.stall --backend vllm``.

One engine in this process serves a random tiny checkpoint; the loop loads
two weight versions alternately, ``--updates`` times, and prints the median
seconds of each phase of the update (abort, pause, reload, cache reset,
resume; megarl/rollout/base.py) and of the whole update. Two situations:

- ``idle``: what the training loop does. The controller aborts every request
  and waits for them to return before it publishes, so the engine has nothing
  in flight when the update arrives.
- ``busy``: requests are generating when the update arrives (an engine driven
  by another client); the engine must stop them itself.

No trainer, no run: it isolates the engine's part of a publish, so that a
change to the update sequence can be measured in seconds, not in a bench run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megarl.rollout.backends import make_engine
from megarl.rollout.base import UPDATE_PHASES, engine_options
from megarl.types import GenerateRequest, SamplingParams

PROMPT = [1, 5, 6, 7]


def summarize_phases(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds of each ``engine_<phase>_s`` and of their sum per update (``engine_update_s``)."""
    keys = [f"engine_{p}_s" for p in UPDATE_PHASES]
    out = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in keys}
    out["engine_update_s"] = statistics.median(sum(s.get(k, 0.0) for k in keys) for s in samples)
    return out


async def _generate_until_cancelled(engine, stop: asyncio.Event, seed: int) -> int:
    n = 0
    while not stop.is_set():
        req = GenerateRequest(f"busy-{seed}-{n}", PROMPT, SamplingParams(max_new_tokens=64, seed=seed + n))
        await engine.generate(req)
        n += 1
    return n


async def measure(backend: str, checkpoints: list[str], updates: int, busy: bool,
                  threads: int = 1) -> list[dict[str, float]]:
    """``updates`` weight updates alternating over ``checkpoints[1:]`` and back; the phases of each."""
    engine = await make_engine(backend, checkpoints[0], **engine_options(backend, 1, threads))
    samples = []
    try:
        await engine.generate(GenerateRequest("warm", PROMPT, SamplingParams(max_new_tokens=8, seed=0)))
        for i in range(updates):
            path = checkpoints[1 + i % (len(checkpoints) - 1)] if i % 2 == 0 else checkpoints[0]
            stop = asyncio.Event()
            load = [asyncio.create_task(_generate_until_cancelled(engine, stop, 100 * i + j)) for j in range(4)] \
                if busy else []
            if load:
                await asyncio.sleep(0.05)  # let them start generating
            phases = await engine.update_weights_from_disk(path, i + 1)
            stop.set()
            await asyncio.gather(*load)
            samples.append(phases)
    finally:
        await engine.close()
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.bench.stall", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--model", default="configs/models/tiny_qwen3.yaml", help="model YAML of the random checkpoints")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--mode", choices=["idle", "busy", "both"], default="both")
    ap.add_argument("--json", action="store_true", help="print the medians as one JSON object")
    args = ap.parse_args(argv)
    from megarl.models.tiny import write_tiny_checkpoint  # lazy: torch, transformers

    with tempfile.TemporaryDirectory(prefix="megarl-stall-") as tmp:
        ckpts = [str(write_tiny_checkpoint(args.model, Path(tmp) / f"v{s}", seed=s)) for s in (0, 1)]
        nbytes = sum(f.stat().st_size for f in Path(ckpts[0]).glob("*.safetensors"))
        result: dict[str, Any] = {"backend": args.backend, "model": args.model, "weights_bytes": nbytes,
                                  "updates": args.updates}
        for mode in (["idle", "busy"] if args.mode == "both" else [args.mode]):
            t0 = time.perf_counter()
            samples = asyncio.run(measure(args.backend, ckpts, args.updates, busy=mode == "busy"))
            result[mode] = summarize_phases(samples)
            result[mode]["wall_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.backend} engine, {args.model} ({nbytes / 1e6:.2f} MB of weights), {args.updates} updates; "
          f"median ms per update:")
    for mode in ("idle", "busy"):
        if mode in result:
            r = result[mode]
            parts = ", ".join(f"{p} {1e3 * r[f'engine_{p}_s']:.1f}" for p in UPDATE_PHASES)
            print(f"  {mode:4s}: total {1e3 * r['engine_update_s']:.1f} ({parts})")
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    sys.exit(main())
