"""Exact old logits of spliced MoE sequences across a real weight update, against the engine (fp32).

The oracle is the engine: with an fp32 HF engine and an fp32 trainer, the
trainer's log-prob of every generated token at the version that sampled it,
replaying the routes of the request that generated it, equals the engine's
``logp_behav`` to ~1e-6. Six requests are stopped after 5 tokens
(``rollout.splice_at_tokens``), the trainer takes one Adam step, the engine
loads the new weights, and the requests go on: their prefix is re-prefilled
under the new weights, with the new weights' own expert choices, and every
later token attends to that prefix. Scoring the second segment with the first
segment's prefix routes (the rule megarl used before: "the prefix keeps its
first routes") misses the engine by ~1e-3; with the second request's own
routes it matches.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from megarl.config.schema import RolloutConfig
from megarl.rollout.interruptible import InterruptibleGeneration
from megarl.rollout.router import EngineRouter
from megarl.types import SamplingParams, TrainBatch, Trajectory
from recovery._scoring import policy_mask, score_versions

ROOT = Path(__file__).resolve().parents[2]
N_TRAJ, SPLICE_AT, MAX_NEW = 6, 5, 14
TOL = 1e-5


@pytest.fixture(scope="module")
def spliced(tmp_path_factory):
    """Six trajectories of versions 0 then 1, the trainer at version 1, and version 0's parameters."""
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.hf_engine import HFEngine
    from megarl.trainer.megatron_trainer import MegatronTrainer

    tmp = tmp_path_factory.mktemp("splice")
    ckpt = write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3_moe.yaml", tmp / "ckpt", seed=3)
    trainer = MegatronTrainer(str(ckpt), micro_batch_tokens=512, lr=1e-3)
    params_v0 = trainer.get_params()

    async def run() -> list[Trajectory]:
        engine = await HFEngine.create(str(ckpt))
        rollout = RolloutConfig(backend="hf", routing_replay=True, routing_replay_strict=True,
                                splice_at_tokens=SPLICE_AT)
        counters = {"n_interrupted": 0, "n_engine_resubmits": 0, "n_routes_missing": 0, "n_splice_holds": 0}
        gen = InterruptibleGeneration(EngineRouter([engine]), rollout, seed=0, counters=counters)
        gen.may_hold = lambda traj: True
        trajs = [Trajectory(f"t{i}", "g", [1, 4 + i, 5 + i, 6, 7 + i, 2]) for i in range(N_TRAJ)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
        tasks = [asyncio.create_task(gen.generate(t, t.prompt_ids, sampling)) for t in trajs]
        while len(gen.held) < N_TRAJ:  # every request stopped at its splice point
            await asyncio.sleep(0.05)
        gen.close()
        # one optimizer step on the partial trajectories (any gradient moves the routers)
        for t in trajs:
            t.advantage = 1.0 if int(t.traj_id[1:]) % 2 else -1.0
        def loss_fn(logp, mb, normalizer):
            return -(logp * mb.advantages).sum() / normalizer["n_valid_tokens"], {}

        trainer.train_step(TrainBatch.from_trajectories(trajs, version=0), loss_fn)
        trainer.save_hf_checkpoint(str(tmp / "v1"))
        await engine.update_weights_from_disk(str(tmp / "v1"), version=1)
        gen.open()
        await asyncio.gather(*tasks)
        await engine.close()
        return trajs

    trajs = asyncio.run(run())
    return trainer, params_v0, trajs


def test_every_trajectory_crossed_the_update(spliced):
    _, _, trajs = spliced
    for t in trajs:
        assert t.versions[:SPLICE_AT] == [0] * SPLICE_AT
        assert set(t.versions[SPLICE_AT:]) == {1}, t.versions


def test_the_trainer_at_each_tokens_version_reproduces_the_engine(spliced):
    trainer, params_v0, trajs = spliced
    batch = TrainBatch.from_trajectories(trajs, version=trainer.version)
    logp_old = score_versions(batch, trainer, lambda v: params_v0 if v == 0 else None)
    mask = policy_mask(batch)
    err = (logp_old - batch.logp_behav).abs()
    second = mask & (batch.versions == 1)
    assert int(second.sum()) >= N_TRAJ * 3
    assert float(err[mask].max()) <= TOL, (float(err[mask & (batch.versions == 0)].max()),
                                           float(err[second].max()))
