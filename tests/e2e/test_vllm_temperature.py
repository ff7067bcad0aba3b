"""`megarl engine --backend vllm` sampling at temperature 0.7 against the Megatron trainer of the same run config.

vLLM reports the processed log-probs (of softmax(logits / T)); the trainer built
for a run with rollout.temperature = T must give the same numbers, or r_d would
measure the temperature instead of the train-inference gap. fp32 on both sides;
one engine start (~20-45 s) is most of the test's time.
"""
import asyncio
from pathlib import Path

from megarl.builder import load_run_config
from megarl.rollout.client import launch_engine_process, stop_engine_process
from megarl.types import GenerateRequest, SamplingParams, TrainBatch, Trajectory

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPTS = [[1, 5 + i, 6, 7] for i in range(4)]
T = 0.7


def test_vllm_logp_behav_at_temperature_equals_the_trainers(ckpt):
    from megarl.builder import build_trainer
    from megarl.trainer.megatron_trainer import MegatronTrainer

    proc, client = launch_engine_process(str(ckpt), "vllm", env=ENV, startup_timeout_s=240)

    async def generate():
        try:
            return [await client.generate(GenerateRequest(f"r{i}", p, SamplingParams(temperature=T, seed=i,
                                                                                    max_new_tokens=24)))
                    for i, p in enumerate(PROMPTS)]
        finally:
            await client.close()

    try:
        results = asyncio.run(generate())
    finally:
        stop_engine_process(proc)
    trajs = [Trajectory(traj_id=r.request_id, group_id="", prompt_ids=p, response_ids=r.output_ids,
                        logp_behav=r.logp_behav, versions=r.versions, loss_mask=[1] * len(r.output_ids))
             for p, r in zip(PROMPTS, results)]
    batch = TrainBatch.from_trajectories(trajs, version=0)
    mask = batch.loss_mask > 0
    cfg = load_run_config(REPO / "configs" / "tiny_cpu.yaml", [f"model.checkpoint={ckpt}", f"rollout.temperature={T}",
                                                               "trainer.micro_batch_tokens=256"])
    trainer = build_trainer(cfg, ckpt)
    gap = (trainer.logprobs(batch) - batch.logp_behav).abs()[mask]
    print(f"\n[temperature {T}] |vLLM - megatron| max {gap.max():.3g} mean {gap.mean():.3g} "
          f"over {int(mask.sum())} tokens")
    assert int(mask.sum()) == 4 * 24 and gap.max() <= 1e-4
    # at temperature 1 the same tokens score differently, so the check above can tell
    raw = MegatronTrainer(str(ckpt), micro_batch_tokens=256).logprobs(batch)
    assert (raw - batch.logp_behav).abs()[mask].max() > 0.05
