"""The GPU checks of the rollout engines (tests/gpu/gpu_check.py): vLLM against the trainer, and the weight
broadcast from a trainer step into a vLLM or HF engine on the GPU, over gloo and NCCL."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

from check_helpers import (
    MAX_NEW,
    Skip,
    batch_from,
    logp_gap,
    make_trainer,
    nll_loss,
    requests,
    require,
    require_cuda,
    require_official_vllm,
    start_engine,
    tiny_checkpoint,
)


def check_vllm_parity(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    from megarl.rollout.client import stop_engine_process

    ckpt = tiny_checkpoint(workdir)
    proc, client = start_engine(ckpt, workdir, "parity")
    try:
        reqs = requests()

        async def go():
            try:
                return await asyncio.gather(*(client.generate(r) for r in reqs))
            finally:
                await client.close()
        results = asyncio.run(go())
    finally:
        stop_engine_process(proc)
    require(all(len(r.output_ids) == MAX_NEW for r in results),
            f"expected {MAX_NEW} tokens per request, got {[len(r.output_ids) for r in results]}")
    batch = batch_from(reqs, results)
    mean, worst, n = logp_gap(make_trainer(ckpt).logprobs(batch), batch)
    require(mean < 0.02 and worst < 0.2, f"trainer (fp32) vs vLLM (bf16) log-probs differ: mean {mean:.3e} "
                                         f"max {worst:.3e} over {n} tokens (limits 0.02 / 0.2)")
    return f"{n} tokens, |trainer fp32 - vLLM bf16| mean {mean:.2e} max {worst:.2e}"


def _broadcast_round_trip(workdir: Path, backend: str, engine_env: dict | None, engine: str = "vllm") -> str:
    from megarl.rollout.client import free_port, stop_engine_process
    from megarl.rollout.router import EngineRouter
    from megarl.rollout.weight_spec import tensor_specs
    from megarl.rollout.weight_sync import WeightBroadcaster

    ckpt = tiny_checkpoint(workdir)
    trainer = make_trainer(ckpt, lr=5e-2)
    proc, client = start_engine(ckpt, workdir, f"broadcast_{engine}_{backend}", env=engine_env, backend=engine)
    reqs = requests(seed0=100)
    try:
        async def before():
            return await asyncio.gather(*(client.generate(r) for r in reqs))
        batch = batch_from(reqs, asyncio.run(before()))
        parity_mean, _, _ = logp_gap(trainer.logprobs(batch), batch)  # engine vs trainer, same weights
        metrics = trainer.train_step(batch, nll_loss)
        require(metrics.get("skipped", 0.0) == 0.0, f"train step skipped: {trainer.last_skip_reason}")
        named = list(trainer.export_hf_weights())
        sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, backend=backend, timeout_s=120)
        box: dict = {}

        def send():
            try:
                box["stats"] = sender.broadcast(iter(named), bucket_bytes=1 << 16)
            except BaseException as e:  # reported below, the engine side fails too
                box["error"] = e

        async def update_and_score():
            th = threading.Thread(target=send, daemon=True)
            th.start()
            try:
                await EngineRouter([client]).update_weights_from_broadcast(sender.group_info(), tensor_specs(named), 1)
            finally:
                await asyncio.to_thread(th.join, 120)
            try:
                return await asyncio.gather(*(client.generate(r) for r in reqs))
            finally:
                await client.close()
        t0 = time.perf_counter()
        after = asyncio.run(update_and_score())
        dt = time.perf_counter() - t0
        sender.close()
        require("error" not in box, f"trainer-side broadcast failed: {box.get('error')!r}")
    finally:
        stop_engine_process(proc)
    require(all(v == 1 for r in after for v in r.versions), "tokens after the update are not tagged version 1")
    new_batch = batch_from(reqs, after, version=1)
    mean, worst, n = logp_gap(trainer.logprobs(new_batch), new_batch)
    stale_mean, _, _ = logp_gap(trainer.logprobs(batch), batch)  # the new weights against the old engine's tokens
    # the weights arrived intact: the engine matches the new weights as closely as it matched the old ones
    # (the engines' own precision, fp32 ~1e-6 or bf16 ~1e-2), and far more closely than the old weights do
    # (an update that did not land, or landed half, would leave the gap at the stale level)
    require(mean <= max(3 * parity_mean, 1e-5),
            f"after the {backend} update the engine misses the trainer's new weights by mean {mean:.3e} (max "
            f"{worst:.3e}), more than 3x the {parity_mean:.3e} it missed the same weights by before the step")
    require(stale_mean >= 5 * mean, f"the step moved the policy too little to tell an update that landed from one "
                                    f"that did not: stale gap {stale_mean:.3e} vs {mean:.3e} after the update")
    return (f"{box['stats']['tensors']} tensors, {box['stats']['bytes'] / 1e6:.1f} MB, update+generate {dt:.1f} s; "
            f"engine vs trainer after update mean {mean:.2e} max {worst:.2e} (same weights before the step "
            f"{parity_mean:.2e}; new weights vs the old engine {stale_mean:.2e})")


def check_broadcast_gloo(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    return _broadcast_round_trip(workdir, "gloo", None)


def check_broadcast_nccl(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    import torch

    if torch.cuda.device_count() < 2 and os.environ.get("GPU_CHECK_FORCE_NCCL") != "1":
        raise Skip("one GPU: NCCL refuses two ranks (trainer, engine) on the same device; "
                   "broadcast_gloo covered the engine side; set GPU_CHECK_FORCE_NCCL=1 to try anyway")
    env = {"CUDA_VISIBLE_DEVICES": "1"} if torch.cuda.device_count() >= 2 else None
    return _broadcast_round_trip(workdir, "nccl", env)


def check_hf_broadcast(workdir: Path) -> str:
    require_cuda()
    return _broadcast_round_trip(workdir, "gloo", None, engine="hf")


def check_hf_broadcast_nccl(workdir: Path) -> str:
    """The NCCL broadcast into the HF engine; with one GPU trainer and engine share the device,
    which NCCL refuses ("Duplicate GPU detected") -- reported as SKIP with NCCL's own words."""
    require_cuda()
    import torch

    env = {"CUDA_VISIBLE_DEVICES": "1"} if torch.cuda.device_count() >= 2 else None
    try:
        return _broadcast_round_trip(workdir, "nccl", env, engine="hf")
    except Exception as e:
        logs = " ".join(p.read_text(errors="replace") for p in workdir.glob("broadcast_hf_nccl*.log"))
        if torch.cuda.device_count() < 2 and "Duplicate GPU" in f"{e} {logs}":
            raise Skip("one GPU: NCCL refused trainer and engine on the same device (Duplicate GPU detected); "
                       "the gloo broadcast covers the engine side") from None
        raise

