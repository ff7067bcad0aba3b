"""trainer.recompute: the same loss and gradients with none, selective and full recomputation (CPU, gloo, one rank).

Recomputation reruns forwards in the backward; it must not change a number
beyond fp32 round-off, also when the MoE routers replay routes (the recomputed
forward replays them again). The gradients are read from megatron's fp32 gradient
buffer (``main_grad``) after one forward-backward over three micro-batches of
the parity batch, on the tiny dense and MoE models.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("recompute")
    return {name: str(write_tiny_checkpoint(REPO / f"configs/models/{name}.yaml", root / name, seed=3))
            for name in ("tiny_qwen3", "tiny_qwen3_moe")}


def batch_routes(batch) -> torch.Tensor:
    """[B, L-1, 2 layers, 2]: position t of row b goes to experts (t+b, t+b+1) mod 4 in layer 0 and
    (3-t-b, 1-t-b) mod 4 in layer 1; every third position has none (routes live) and so has the padding."""
    B, L = batch.tokens.shape
    t = torch.arange(L - 1)[None, :] + torch.arange(B)[:, None]
    routes = torch.stack([torch.stack([t % 4, (t + 1) % 4], -1), torch.stack([(3 - t) % 4, (1 - t) % 4], -1)],
                         dim=2).to(torch.int16)
    routes[:, ::3] = -1
    routes[torch.arange(L - 1)[None] >= (batch.seq_lens[:, None] - 1)] = -1
    return routes


def loss_and_grads(ckpt: str, recompute: str, replay: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    from test_parity_hf import make_batch

    from megarl.trainer.megatron_trainer import MegatronTrainer
    from megarl.trainer.routing_replay import routers

    trainer = MegatronTrainer(ckpt, micro_batch_tokens=48, recompute=recompute)
    batch = make_batch(0)
    if replay:
        batch.routes = batch_routes(batch)
    n = float(batch.loss_mask.sum())
    losses = []

    def loss_func(mb, ce):
        if mb.dummy:
            return ce.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}
        loss = (ce.float() * mb.batch.loss_mask).sum() / n
        losses.append(float(loss.detach()))
        return loss, torch.tensor(1, dtype=torch.int), {}

    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer._run(batch, loss_func, forward_only=False)
    # the pass leaves no replay state behind: every recomputed layer took its queued routes, none is left
    assert all(r.router_replay_action is None and not r.replay_backward_list for _, r in routers(trainer.model))
    grads = {name: p.main_grad.detach().clone() for name, p in trainer._module().named_parameters()}
    return sum(losses), grads


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_recompute_keeps_loss_and_gradients(ckpts, model):
    loss0, grads0 = loss_and_grads(ckpts[model], "none")
    assert loss0 > 1.0  # random init over a 16-token vocabulary: ~log(16) = 2.77 per token
    assert sum(float(g.abs().sum()) for g in grads0.values()) > 0
    for recompute in ("selective", "full"):
        loss, grads = loss_and_grads(ckpts[model], recompute)
        assert loss == pytest.approx(loss0, rel=1e-6), recompute
        assert grads.keys() == grads0.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, grads0[name], rtol=1e-5, atol=1e-7, msg=f"{recompute}: {name}")


def test_recompute_sets_megatron_fields(ckpts):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    full = MegatronTrainer(ckpts["tiny_qwen3"], recompute="full").config
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    sel = MegatronTrainer(ckpts["tiny_qwen3"], recompute="selective").config
    assert (sel.recompute_granularity, sel.recompute_method, sel.recompute_modules) == ("selective", None,
                                                                                          ["core_attn"])
    assert MegatronTrainer(ckpts["tiny_qwen3"]).config.recompute_granularity is None


def test_recompute_value_is_checked():
    from megarl.errors import ConfigError
    from megarl.models.hf_config import recompute_fields

    with pytest.raises(ConfigError, match="recompute 'some' is not one of none, selective, full"):
        recompute_fields("some")


def test_run_config_reaches_the_trainer(monkeypatch, tmp_path):
    from megarl import builder
    from megarl.config import MegaRLConfig

    seen = {}
    monkeypatch.setattr(builder, "MegatronTrainer", lambda ckpt, **kw: seen.update(kw))
    cfg = MegaRLConfig()
    cfg.trainer.recompute, cfg.model.allow_local_spec = "full", True
    builder.build_trainer(cfg, tmp_path)
    assert (seen["recompute"], seen["allow_local_spec"]) == ("full", True)


def test_full_recompute_replays_the_routes_in_the_backward_too(ckpts):
    # the recomputed forward runs in the backward, after the micro-batch's forward returned: its routers must
    # take the same routes again (every third position has none and routes live, in both forwards)
    loss0, grads0 = loss_and_grads(ckpts["tiny_qwen3_moe"], "none", replay=True)
    loss, grads = loss_and_grads(ckpts["tiny_qwen3_moe"], "full", replay=True)
    assert loss == pytest.approx(loss0, abs=1e-6)
    assert grads.keys() == grads0.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, grads0[name], rtol=0.0, atol=1e-6, msg=name)
    # the replay is not vacuous: routing live gives another loss (2.8e-4 off) and other gradients (1.2e-2)
    live_loss, live_grads = loss_and_grads(ckpts["tiny_qwen3_moe"], "full")
    assert abs(live_loss - loss0) > 1e-4
    assert max(float((live_grads[name] - g).abs().max()) for name, g in grads0.items()) > 1e-3
