"""`megarl engine --backend vllm --dtype bfloat16` (vLLM CPU) against the bf16 Megatron trainer.

The tolerance is the one of tests/unit/test_bf16.py (one bf16 eps times the
largest |log-prob| the fp32 trainer gives the same tokens); measured here:
max 0.007, mean 0.0009 over 96 sampled tokens of the tiny random model
(tolerance 0.025). One engine start (~20-45 s) is most of the test's time.
On a host with AMX this is also the test that caught vLLM's bf16 attention dying of SIGILL when the
engine's processes had not asked for AMX state (megarl/platform/amx.py; it prints which kind of host ran).
"""
import asyncio

import torch

from megarl.platform.amx import host_has_amx
from megarl.rollout.client import launch_engine_process, stop_engine_process
from megarl.types import GenerateRequest, SamplingParams, TrainBatch, Trajectory

ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS = [[1, 5 + i, 6, 7] for i in range(4)]


def test_vllm_engine_in_bf16_matches_the_bf16_trainer(ckpt):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    proc, client = launch_engine_process(str(ckpt), "vllm", extra_args=["--dtype", "bfloat16"], env=ENV,
                                         startup_timeout_s=240)

    async def generate():
        try:
            health = await client.health()
            results = [await client.generate(GenerateRequest(f"r{i}", p, SamplingParams(temperature=1.0, seed=i,
                                                                                         max_new_tokens=24)))
                       for i, p in enumerate(PROMPTS)]
            return health, results
        finally:
            await client.close()

    try:
        health, results = asyncio.run(generate())
    finally:
        stop_engine_process(proc)
    assert health["dtype"] == "bfloat16", health
    trajs = [Trajectory(traj_id=r.request_id, group_id="", prompt_ids=p, response_ids=r.output_ids,
                        logp_behav=r.logp_behav, versions=r.versions, loss_mask=[1] * len(r.output_ids))
             for p, r in zip(PROMPTS, results)]
    batch = TrainBatch.from_trajectories(trajs, version=0)
    mask = batch.loss_mask > 0
    bf16 = MegatronTrainer(str(ckpt), dtype="bfloat16", micro_batch_tokens=256).logprobs(batch)
    fp32 = MegatronTrainer(str(ckpt), micro_batch_tokens=256).logprobs(batch)
    tol = torch.finfo(torch.bfloat16).eps * float(fp32[mask].abs().max())
    gap = (bf16 - batch.logp_behav).abs()[mask]
    print(f"\n[bf16] |vLLM bf16 - megatron bf16| max {gap.max():.4f} mean {gap.mean():.5f} (tol {tol:.4f}, "
          f"{int(mask.sum())} tokens; host AMX: {host_has_amx()})")
    assert gap.max() <= tol
