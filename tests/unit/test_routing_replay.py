"""Routing replay (megarl/trainer/routing_replay.py) on the real megatron-core MoE stack, against HF.

The reference is the HF Qwen3-MoE model (which megarl's trainer matches to ~2e-7
with live routing) with each layer's router forced to the given top-k: a
replayed trainer forward must equal it. The model: 2 layers, 4 experts, top-2
(configs/models/tiny_qwen3_moe.yaml).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megarl.errors import InputError
from megarl.routes import RouteSegment, compact
from megarl.types import TrainBatch, Trajectory

ROOT = Path(__file__).resolve().parents[2]
SEQS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 9, 9, 4, 6, 11, 2]]  # two rows, different lengths
LAYERS, K = 2, 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import transformers

    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer.megatron_trainer import MegatronTrainer

    ckpt = write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3_moe.yaml", tmp_path_factory.mktemp("moe") / "c",
                                 seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return MegatronTrainer(str(ckpt), micro_batch_tokens=64), hf


def hf_logprobs(hf, seq: list[int], forced: torch.Tensor | None = None) -> torch.Tensor:
    """HF log-probs of ``seq[1:]``; ``forced`` [positions, layers, k] (-1: that position routes live)."""
    saved = []
    for layer, block in enumerate(hf.model.layers):
        gate = block.mlp.gate
        saved.append((gate, gate.forward))

        def forward(h, gate=gate, layer=layer):
            logits = F.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            _, live = torch.topk(probs, gate.top_k, dim=-1)
            idx = live
            if forced is not None:
                want = forced[: logits.shape[0], layer].long()
                idx = torch.where((want >= 0).all(-1, keepdim=True), want, live)
            top = probs.gather(1, idx)
            top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
            return logits, top.to(logits.dtype), idx

        gate.forward = forward
    try:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    finally:
        for gate, fwd in saved:
            gate.forward = fwd
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def batch_of(routes_per_row: list | None) -> TrainBatch:
    """The two rows, each with one route segment of version 0 covering ``routes_per_row[b]`` ([n, layers, k],
    -1 where a position has none)."""
    trajs = []
    for i, seq in enumerate(SEQS):
        n = len(seq) - 2
        t = Trajectory(f"t{i}", "g", seq[:2], seq[2:], [0.0] * n, [0] * n, [1] * n)
        if routes_per_row is not None:
            t.add_route_segment(RouteSegment(1, compact(routes_per_row[i]), version=0))
        trajs.append(t)
    return TrainBatch.from_trajectories(trajs, version=0)


def hand_routes(n: int) -> torch.Tensor:
    """[n, layers, k]: position t goes to experts (t, t+1) mod 4 in layer 0 and (3-t, 1-t) mod 4 in layer 1."""
    return torch.tensor([[[t % 4, (t + 1) % 4], [(3 - t) % 4, (1 - t) % 4]] for t in range(n)])


def hf_live_routes(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([seq]), output_router_logits=True)
    return torch.stack([r.topk(K, dim=-1).indices for r in out.router_logits], dim=1)


def test_a_replayed_forward_equals_a_forward_whose_routers_are_forced_to_those_experts(moe):
    trainer, hf = moe
    routes = [hand_routes(len(s)) for s in SEQS]
    replayed = trainer.logprobs(batch_of(routes))
    live = trainer.logprobs(batch_of(None))
    for b, seq in enumerate(SEQS):
        n = len(seq) - 1
        forced = hf_logprobs(hf, seq, routes[b])
        assert torch.allclose(replayed[b, :n], forced, atol=2e-6), (replayed[b, :n] - forced).abs().max()
        # not vacuous: the hand-built routes are not the live ones
        assert (replayed[b, :n] - live[b, :n]).abs().max() > 1e-3


def test_replaying_the_live_routes_changes_no_log_prob(moe):
    trainer, hf = moe
    live = trainer.logprobs(batch_of(None))
    replayed = trainer.logprobs(batch_of([hf_live_routes(hf, s) for s in SEQS]))
    assert torch.allclose(replayed, live, atol=1e-6), (replayed - live).abs().max()
    for b, seq in enumerate(SEQS):
        assert torch.allclose(live[b, : len(seq) - 1], hf_logprobs(hf, seq), atol=2e-6)


def test_positions_without_routes_route_live(moe):
    trainer, hf = moe
    routes = [hand_routes(len(s)) for s in SEQS]
    for r in routes:
        r[3:] = -1  # known for the first three positions only (as after a lost request's prefix)
    replayed = trainer.logprobs(batch_of(routes))
    for b, seq in enumerate(SEQS):
        n = len(seq) - 1
        assert torch.allclose(replayed[b, :n], hf_logprobs(hf, seq, routes[b]), atol=2e-6)


def test_the_gradient_step_replays_too(moe):
    # the loss of a train step on replayed routes is the loss of the replayed log-probs
    trainer, _ = moe
    batch = batch_of([hand_routes(len(s)) for s in SEQS])
    expected = trainer.logprobs(batch)
    seen = []

    def loss_fn(logp, mb, normalizer):
        seen.append((mb.traj_ids, logp.detach()))
        return -(logp * mb.loss_mask).sum() * 0.0, {}

    params = trainer.get_params()
    trainer.train_step(batch, loss_fn)
    trainer.set_params(params)
    assert sum(len(ids) for ids, _ in seen) == len(SEQS)
    for ids, logp in seen:
        for j, b in enumerate(int(i[1:]) for i in ids):
            n = len(SEQS[b]) - 1
            assert torch.allclose(logp[j, :n], expected[b, :n], atol=1e-6)


def test_a_dense_model_refuses_routes(tmp_path):
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer.megatron_trainer import MegatronTrainer

    ckpt = write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3.yaml", tmp_path / "dense", seed=0)
    dense = MegatronTrainer(str(ckpt), micro_batch_tokens=64)
    with pytest.raises(InputError, match="is dense"):
        dense.logprobs(batch_of([hand_routes(len(s)) for s in SEQS]))


def test_the_hf_engine_returns_its_routes_and_replaying_them_reproduces_logp_behav(moe, tmp_path):
    import asyncio

    from megarl.rollout.hf_engine import HFEngine
    from megarl.types import GenerateRequest, SamplingParams

    trainer, _ = moe

    async def generate():
        engine = await HFEngine.create(trainer.checkpoint_dir)
        return await engine.generate(GenerateRequest("r", [1, 5, 6, 7], SamplingParams(max_new_tokens=8, seed=1),
                                                     return_routes=True))

    res = asyncio.run(generate())
    n = 4 + len(res.output_ids)
    seg, = res.routes  # one forward history: one route segment, owning the predictions from the last prompt token
    assert (seg.start, seg.end) == (3, n - 1) and seg.routes.shape == (n - 1, LAYERS, K)
    assert seg.routes.dtype == np.uint8 and all(len(set(experts)) == K for r in seg.routes for experts in r)
    seg.version = 0
    traj = Trajectory("r", "g", [1, 5, 6, 7], res.output_ids, res.logp_behav, res.versions,
                      [1] * len(res.output_ids), route_segments=[seg])
    batch = TrainBatch.from_trajectories([traj], version=0)
    assert batch.routes.shape == (1, n - 1, LAYERS, K) and batch.routes.dtype == torch.int16
    logp = trainer.logprobs(batch)[0, 3:n - 1]
    assert torch.allclose(logp, torch.tensor(res.logp_behav), atol=1e-5)


def test_routing_replay_is_refused_only_for_a_dense_model():
    from megarl.builder import load_run_config
    from megarl.errors import ConfigError
    from megarl.preflight import check_routing_replay

    moe_hf = {"model_type": "qwen3_moe", "num_local_experts": 4}
    base = ["rollout.routing_replay=true", "rollout.backend=hf"]
    check_routing_replay(load_run_config(None, base), moe_hf)
    check_routing_replay(load_run_config(None, ["rollout.routing_replay=true", "rollout.backend=vllm"]), moe_hf)
    with pytest.raises(ConfigError, match="needs an MoE model"):
        check_routing_replay(load_run_config(None, base), {"model_type": "qwen3"})
    check_routing_replay(load_run_config(None, [*base, "recovery.name=dedicated", "parallel.tp=2"]), moe_hf)
    check_routing_replay(load_run_config(None, ["rollout.routing_replay=true", "rollout.backend=vllm"]), moe_hf)
    # several trainer ranks: the followers rebuild each batch from the trajectories rank 0 sends, routes
    # included (tests/distributed/test_parallel.py::test_loop_followers_replay_the_routes_rank0_sent)
    check_routing_replay(load_run_config(None, [*base, "placement.trainer_ranks=2"]), moe_hf)
    # full recompute: the recomputed layers replay too (tests/unit/test_recompute.py)
    check_routing_replay(load_run_config(None, [*base, "trainer.recompute=full"]), moe_hf)


def test_the_dedicated_scorer_replays_the_routes_of_each_segment(moe):
    from recovery._dedicated_scorer import _score

    trainer, _ = moe
    routes = [hand_routes(len(s)) for s in SEQS]
    expected = trainer.logprobs(batch_of(routes))
    # the job of the first row's second segment (response tokens 3..6), with the routes of the positions its
    # forward feeds (prompt 2 + 6 response tokens - the last one)
    job = {"traj_id": "t0", "start": 3, "end": 6, "version": 0, "prompt_ids": SEQS[0][:2],
           "response_ids": SEQS[0][2:8], "routes": compact(routes[0][:7])}
    (_, start, end, logps, _), = _score(trainer, [job])
    assert (start, end) == (3, 6)
    assert torch.allclose(torch.tensor(logps), expected[0, 1 + 3:1 + 6], atol=1e-6)


def test_route_disagreement_on_hand_numbers():
    from megarl.trainer.routing_replay import route_disagreement

    # one row, three positions, two layers, top-2; the last position is unknown to the engine
    engine = torch.tensor([[[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[-1, -1], [-1, -1]]]])
    trainer = torch.tensor([[[[1, 0], [2, 3]], [[1, 2], [3, 2]], [[0, 1], [0, 1]]]])
    m = route_disagreement(engine, trainer)
    # position 0: same sets in both layers (order does not matter); position 1: layer 0 differs
    assert m == {"routes/n_tokens": 2.0, "routes/n_decisions": 4.0, "routes/decisions_differ_frac": 0.25,
                 "routes/tokens_differ_frac": 0.5}


def test_live_routes_are_the_routers_own_choices(moe):
    from megarl.trainer.routing_replay import live_routes

    trainer, hf = moe
    batch = batch_of(None)
    live = live_routes(trainer, batch)
    assert live.shape == (2, len(SEQS[0]) - 1, LAYERS, K)
    for b, seq in enumerate(SEQS):
        n = len(seq) - 1
        want = hf_live_routes(hf, seq)[:n]
        assert torch.equal(live[b, :n].sort(-1).values, want.sort(-1).values.to(torch.int16)), want
        assert (live[b, n:] == -1).all()
    # replaying does not disturb what the routers are left with: a plain forward afterwards is live again
    assert torch.allclose(trainer.logprobs(batch), trainer.logprobs(batch_of(None)))


def test_routes_survive_a_checkpoint_of_the_trajectory():
    t = Trajectory("t", "g", [1, 5], [6], [0.0], [0], [1])
    t.add_route_segment(RouteSegment(1, compact([[[0, 1]], [[2, 3]]]), version=0))
    back = Trajectory.from_dict(t.to_dict())
    (seg,) = back.route_segments
    assert (seg.start, seg.version) == (1, 0) and np.array_equal(seg.routes, t.route_segments[0].routes)
