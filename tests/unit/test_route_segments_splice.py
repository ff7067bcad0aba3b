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
        counters = {"n_interrupted": 0, "n_engine_resubmits": 0, "n_routes_missing": 0, "n_splice_holds": 0,
                    "n_engine_prefix_cached_tokens": 0}
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


def _engine_gap(logp, batch) -> float:
    mask = policy_mask(batch)
    return float((logp - batch.logp_behav).abs()[mask].max())


def test_every_exact_scoring_path_reproduces_the_engine(spliced):
    # the reference of verify-recovery, interrupt_sync's per-version scoring and the dedicated scorer's jobs each
    # pick the routes of the request that generated a token by themselves: each must reproduce the engine
    from types import SimpleNamespace

    from recovery._dedicated_scorer import _score
    from recovery._reference import true_logp_old
    from recovery._scoring import scoring_segments
    from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig

    trainer, params_v0, trajs = spliced
    batch = TrainBatch.from_trajectories(trajs, version=trainer.version)
    params = {0: params_v0, 1: trainer.get_params()}
    assert _engine_gap(true_logp_old(batch, params, trainer), batch) <= TOL
    # interrupt_sync: version 0's tokens with the kept copy of version 0, then version 1's with the current weights
    copies = [Trajectory.from_dict(t.to_dict()) for t in trajs]
    sync = InterruptSync(InterruptSyncConfig(), SimpleNamespace(trainer=trainer))
    sync._kept, sync._kept_version = params_v0, 0
    assert sync._score(copies, 0) == N_TRAJ * SPLICE_AT
    sync._kept, sync._kept_version = params[1], 1
    sync._score(copies, 1)
    for t in copies:
        assert max(abs(a - b) for a, b in zip(t.logp_old, t.logp_behav)) <= TOL
    # the dedicated scorer, at version 1, on the second segments' jobs
    jobs = [{"traj_id": t.traj_id, "start": s.start, "end": s.end, "version": s.version, "prompt_ids": t.prompt_ids,
             "response_ids": t.response_ids[:s.end], "routes": rs.routes[:len(t.prompt_ids) + s.end - 1]}
            for t in trajs for s, rs in scoring_segments(t) if s.version == 1]
    assert len(jobs) == N_TRAJ
    for (tid, start, end, logps, _), t in zip(_score(trainer, jobs), trajs):
        assert tid == t.traj_id
        assert max(abs(a - b) for a, b in zip(logps, t.logp_behav[start:end])) <= TOL


@pytest.mark.parametrize("control", ["routes_first_prefix", "routes_shifted", "routes_other_version"])
def test_wrong_routes_miss_the_engine(spliced, control):
    # the negative controls of verify-recovery's oracle, here on the same sequences: each misses by far more than
    # the tolerance, so a check against the engine cannot pass them
    from recovery._negative_controls import ROUTE_CONTROLS

    trainer, params_v0, trajs = spliced
    wrong = [Trajectory.from_dict({**t.to_dict(), "route_segments": []}) for t in trajs]
    for t, orig in zip(wrong, trajs):
        t.route_segments = ROUTE_CONTROLS[control](list(orig.route_segments))
    batch = TrainBatch.from_trajectories(wrong, version=trainer.version)
    logp_old = score_versions(batch, trainer, lambda v: params_v0 if v == 0 else None)
    assert _engine_gap(logp_old, batch) > 1e-4
