"""The vLLM CPU engine's MoE routes (captured by megarl's worker extension) replayed by the Megatron trainer.

One engine (in this process) serves every test: a vLLM engine costs ~20-40 s to start. Times per engine step
without and with route capture are printed with a ``MEASURE`` prefix (-s).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.models.tiny import write_tiny_checkpoint
from megarl.routes import RouteSegment, as_int16, compact
from megarl.types import GenerateRequest, SamplingParams, TrainBatch, Trajectory
from recovery._scoring import score_versions

ROOT = Path(__file__).resolve().parents[2]
LAYERS, K, EXPERTS = 2, 2, 4
PROMPTS = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 9, 4, 6, 11, 2]]
NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megarl.rollout.vllm_engine import VLLMEngine
    from megarl.trainer.megatron_trainer import MegatronTrainer

    ckpt = write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3_moe.yaml", tmp_path_factory.mktemp("moe") / "c",
                                 seed=3)
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(VLLMEngine.create(str(ckpt), kv_cache_gib=1, cpu_threads=1))
    yield loop, engine, MegatronTrainer(str(ckpt), micro_batch_tokens=256)
    loop.run_until_complete(engine.close())
    loop.close()


def _requests(routes: bool, tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", p, SamplingParams(max_new_tokens=NEW, seed=10 + i), return_routes=routes)
            for i, p in enumerate(PROMPTS)]


def _batch(loop, engine, reqs):
    """Generate ``reqs`` in one batch; (results, seconds per engine step)."""
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    t0 = time.perf_counter()
    results = loop.run_until_complete(go())
    return results, (time.perf_counter() - t0) / NEW


def test_routes_cover_every_fed_position_and_replay_to_logp_behav(setup):
    loop, engine, trainer = setup
    _batch(loop, engine, _requests(False, "w"))  # warm-up: first calls compile and allocate
    plain, before = _batch(loop, engine, _requests(False, "a"))  # nothing hooked yet
    routed, capturing = _batch(loop, engine, _requests(True, "b"))
    again, after = _batch(loop, engine, _requests(False, "c"))  # hooked, nobody asking
    print(f"\nMEASURE vLLM CPU step, {len(PROMPTS)} requests: {before * 1e3:.1f} ms before any capture, "
          f"{capturing * 1e3:.1f} ms capturing routes, {after * 1e3:.1f} ms hooked but not asked")
    for p, r, a in zip(plain, routed, again):
        # asking for routes changes nothing else: same seeded tokens, same log-probs
        assert r.output_ids == p.output_ids == a.output_ids
        assert torch.allclose(torch.tensor(r.logp_behav), torch.tensor(p.logp_behav), atol=1e-6)
        assert p.routes is None and a.routes is None
    trajs = []
    for prompt, res in zip(PROMPTS, routed):
        n = len(prompt) + len(res.output_ids)
        seg, = res.routes  # one forward history: every fed position, the shared prompt's cached positions too
        assert (seg.start, seg.end) == (len(prompt) - 1, n - 1) and seg.routes.shape == (n - 1, LAYERS, K)
        assert all(len(set(e)) == K for r in seg.routes.tolist() for e in r) and int(seg.routes.max()) < EXPERTS
        seg.version = 0
        trajs.append(Trajectory(res.request_id, "g", prompt, res.output_ids, res.logp_behav, res.versions,
                                [1] * len(res.output_ids), route_segments=[seg]))
    n0 = len(PROMPTS[0])  # one prompt, one routing
    assert (routed[0].routes[0].routes[:n0] == routed[1].routes[0].routes[:n0]).all()
    batch = TrainBatch.from_trajectories(trajs, version=0)
    replayed, live = trainer.logprobs(batch), trainer.logprobs(TrainBatch.from_trajectories(
        [Trajectory(t.traj_id, "g", t.prompt_ids, t.response_ids, t.logp_behav, t.versions, t.loss_mask)
         for t in trajs], version=0))
    worst_live = 0.0
    for b, (prompt, res) in enumerate(zip(PROMPTS, routed)):
        cut = slice(len(prompt) - 1, len(prompt) + len(res.output_ids) - 1)
        behav = torch.tensor(res.logp_behav)
        assert torch.allclose(replayed[b, cut], behav, atol=1e-5), (replayed[b, cut] - behav).abs().max()
        worst_live = max(worst_live, float((live[b, cut] - behav).abs().max()))
    print(f"MEASURE max |logp_trainer - logp_behav| on vLLM's routes, fp32: live routing {worst_live:.2e}")
    # not vacuous: the same routes one position off do not reproduce logp_behav
    def shift(seg):
        rows = as_int16(seg.routes)
        return RouteSegment(seg.start, compact(np.concatenate([rows[1:], rows[-1:] * 0 - 1])), seg.version)

    shifted = [Trajectory(t.traj_id, "g", t.prompt_ids, t.response_ids, t.logp_behav, t.versions, t.loss_mask,
                          route_segments=[shift(s) for s in t.route_segments]) for t in trajs]
    off = trainer.logprobs(TrainBatch.from_trajectories(shifted, version=0))
    assert max(float((off[b] - replayed[b]).abs().max()) for b in range(len(trajs))) > 1e-3
    # the worker keeps nothing: the asked-for routes were taken, the others never recorded
    assert loop.run_until_complete(engine.llm.collective_rpc("megarl_routes_pending")) == [0]


def test_only_requests_that_ask_skip_the_prefix_cache(setup):
    # a cached prompt position is not computed, so it would have no route: requests asking for captured routes
    # compute their whole prompt; the others read the cache as before
    _, engine, _ = setup
    req = _requests(True, "d")[0]
    asked = engine._sampling_params(req, NEW, "capture")
    assert asked.skip_reading_prefix_cache is True and asked.extra_args == {"megarl_routes": True}
    plain = engine._sampling_params(req, NEW)
    assert not plain.skip_reading_prefix_cache and not plain.extra_args


def test_an_aborted_request_returns_the_routes_of_what_it_fed_and_its_resubmission_adds_the_rest(setup):
    loop, engine, trainer = setup
    prompt = [1, 5, 6, 7]
    sampling = SamplingParams(max_new_tokens=110, seed=3)

    async def interrupted():
        task = asyncio.ensure_future(engine.generate(GenerateRequest("x", prompt, sampling, return_routes=True)))
        await asyncio.sleep(0.15)  # mid-answer: ~2-4 ms per step
        await engine.abort_all()
        first = await task
        rest = await engine.generate(GenerateRequest("x", prompt + first.output_ids, SamplingParams(
            max_new_tokens=110 - len(first.output_ids), seed=4), return_routes=True))
        return first, rest

    first, rest = loop.run_until_complete(interrupted())
    assert first.finish_reason == "abort" and 0 < len(first.output_ids) < 110
    n = len(prompt) + len(first.output_ids)
    (seg1,), (seg2,) = first.routes, rest.routes
    assert (seg1.start, seg1.end) == (len(prompt) - 1, n - 1) and seg1.routes.shape[1:] == (LAYERS, K)
    # the resubmission re-prefilled prompt + partial answer: its own routes cover that prefix and what it added
    assert (seg2.start, seg2.end) == (n - 1, n + len(rest.output_ids) - 1)
    traj = Trajectory("x", "g", prompt, [])
    for seg, res in ((seg1, first), (seg2, rest)):
        seg.version = 0
        traj.add_route_segment(seg)
        traj.append_policy(res.output_ids, res.logp_behav, res.versions)
    batch = TrainBatch.from_trajectories([traj], version=0)
    got = score_versions(batch, trainer, lambda v: None)[0]
    behav = torch.tensor(first.logp_behav + rest.logp_behav)
    got = got[len(prompt) - 1:len(prompt) - 1 + len(behav)]
    assert torch.allclose(got, behav, atol=1e-5), (got - behav).abs().max()
    assert loop.run_until_complete(engine.llm.collective_rpc("megarl_routes_pending")) == [0]
