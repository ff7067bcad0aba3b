"""Approximate anchors: PPO-EWMA (bias correction, default beta, reset), recompute, loglinear, linear."""
import math
import warnings

import pytest
import torch
from recovery_scorer import HFScorerForTests, LoopState, drive_history, tiny_checkpoint

from megarl.losses import PolicyLossConfig
from megarl.types import TrainBatch
from recovery.ewma import Ewma, EwmaConfig, default_beta, ewma_update
from recovery.linear import Linear, LinearConfig
from recovery.loglinear import Loglinear, LoglinearConfig, proximal_alpha
from recovery.recompute import Recompute, RecomputeConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


# ---------------------------------------------------------------- ewma


def test_ewma_bias_corrected_numbers():
    # beta = 0.5 over theta = 1, 2, 3:
    #   n=1     phi = 1
    #   n=1.5   phi = 1*(0.5/1.5) + 2/1.5            = 1.6667
    #   n=1.75  phi = 1.6667*(0.75/1.75) + 3/1.75    = 2.4286
    phi, n = None, 0.0
    got = []
    for theta in (1.0, 2.0, 3.0):
        phi, n = ewma_update(phi, n, {"w": torch.tensor([theta, 10 * theta])}, beta=0.5)
        got.append(phi["w"].tolist())
    assert n == 1.75
    assert got[0] == [1.0, 10.0]
    assert got[1] == pytest.approx([5 / 3, 50 / 3], rel=1e-6)
    assert got[2] == pytest.approx([17 / 7, 170 / 7], rel=1e-6)
    assert [round(g[0], 4) for g in got] == [1.0, 1.6667, 2.4286]
    assert phi["w"].dtype == torch.float32


def test_ewma_phi_stays_fp32_for_bf16_theta():
    phi, n = ewma_update(None, 0.0, {"w": torch.tensor([1.0], dtype=torch.bfloat16)}, beta=0.99)
    phi, n = ewma_update(phi, n, {"w": torch.tensor([1.0078125], dtype=torch.bfloat16)}, beta=0.99)
    assert phi["w"].dtype == torch.float32 and 1.0 < float(phi["w"]) < 1.0078125


def test_default_beta():
    assert default_beta(4, 1) == pytest.approx(2 / 3)  # 0.667: EWMA age 2 steps = W/2
    assert default_beta(2, 1) == pytest.approx(0.5)
    assert default_beta(4, 2) == pytest.approx(0.8)
    age = default_beta(4, 1) / (1 - default_beta(4, 1))
    assert age == pytest.approx(2.0)


def test_ewma_beta_resolution(ckpt):
    trainer = HFScorerForTests(ckpt)
    ctx = LoopState().context(trainer)
    assert Ewma(EwmaConfig(window=4, steps_per_version=1, tau=0.0), ctx).beta == pytest.approx(2 / 3)
    assert Ewma(EwmaConfig(beta=0.9, tau=0.0), ctx).beta == 0.9
    ctx.eta, ctx.publish_every = 1, 1  # W = eta + 1 = 2, M = 1: beta = 2/4
    assert Ewma(EwmaConfig(tau=0.0), ctx).beta == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"beta=1.0 must lie in \[0, 1\)"):
        Ewma(EwmaConfig(beta=1.0), ctx)


def test_ewma_default_beta_with_publish_every_2(ckpt):
    # With trainer.publish_every = 2 the engines receive versions 0, 2, 4, ... (a version is the number of
    # optimizer steps) and rollout.eta bounds a token's lag in those same optimizer steps (lags 0, 1, 2 for
    # eta = 2; tests/unit/test_staleness_gate.py). The window is eta + 1 = 3 optimizer steps whatever
    # publish_every is: age 3/2 steps, beta = 3 / (3 + 2) = 0.6 (not M*(eta+1) = 6 steps, beta 0.75).
    ctx = LoopState().context(HFScorerForTests(ckpt))
    ctx.eta, ctx.publish_every = 2, 2
    ewma = Ewma(EwmaConfig(tau=0.0), ctx)
    assert ewma.beta == pytest.approx(0.6)
    assert ewma.beta / (1 - ewma.beta) == pytest.approx(1.5)  # centre of mass mid-window, in optimizer steps
    ctx.eta = 3  # window 4 steps: beta = 4/6
    assert Ewma(EwmaConfig(tau=0.0), ctx).beta == pytest.approx(2 / 3)
    # an explicit window W counts published versions of M = publish_every steps each: M*W = 2*2 = 4 -> 4/6
    assert Ewma(EwmaConfig(window=2, tau=0.0), ctx).beta == pytest.approx(2 / 3)
    assert Ewma(EwmaConfig(window=2, steps_per_version=3, tau=0.0), ctx).beta == pytest.approx(0.75)  # 6/8


def _ewma_run(ckpt, tau, loss_cfg, steps=2):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=tau), loop.context(trainer, loss_cfg=loss_cfg))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    return trainer, strat, batch, trajs


def test_ewma_anchor_is_forward_with_phi(ckpt):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop.context(trainer))
    batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True)
    # phi was initialized from theta at the first anchor... which never happened in the history:
    # the first anchor initializes it from the current theta (version 9)
    a0 = strat.anchor(batch, trajs)
    assert torch.equal(a0.logp_anchor, trainer.logprobs(batch)) and a0.metrics["ewma/n"] == 1.0
    thetas = [trainer.get_params()]
    for _ in range(2):
        trainer.fake_step()
        strat.after_optimizer_step(trainer.version, {})
        thetas.append(trainer.get_params())
    phi, n = None, 0.0
    for th in thetas:
        phi, n = ewma_update(phi, n, th, 0.5)
    with trainer.use_params(phi):
        expected = trainer.logprobs(batch)
    got = strat.anchor(batch, trajs)
    assert not got.exact and got.metrics["ewma/n"] == pytest.approx(1.75)
    assert torch.allclose(got.logp_anchor, expected, atol=1e-6)
    assert not torch.allclose(got.logp_anchor, trainer.logprobs(batch), atol=1e-3)
    assert strat.overhead()["extra_param_copies"] == 1


def test_ewma_auto_reset_takes_effect_for_the_triggering_batch(ckpt):
    # a tight behaviour mask: the engine's logp_behav (-1.0 - 0.1 i) is far from the model's,
    # so w = exp(anchor - behav) falls outside [0.9, 1.1] and almost no token is active
    tight = PolicyLossConfig(behav_weight="mask", behav_low=0.9, behav_high=1.1)
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.5), loop.context(trainer, loss_cfg=tight))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    strat.anchor(batch, trajs)
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    assert strat.state_dict()["n"] == 1.5
    res = strat.anchor(batch, trajs)
    assert res.metrics["ewma/reset"] == 1.0 and res.metrics["ewma/active_frac_pre"] < 0.5
    assert strat.state_dict()["n"] == 1.0 and strat.n_resets >= 1
    # the triggering batch already uses the reset phi = theta
    assert torch.equal(res.logp_anchor, trainer.logprobs(batch))
    assert torch.equal(strat.state_dict()["phi"]["model.embed_tokens.weight"],
                       trainer.get_params()["model.embed_tokens.weight"])
    assert strat.overhead()["n_resets"] >= 1


def test_ewma_tau_warns_when_nothing_can_be_masked(ckpt):
    with pytest.warns(UserWarning, match="tau=0.5 has no effect"):
        Ewma(EwmaConfig(beta=0.5, tau=0.5), LoopState().context(HFScorerForTests(ckpt), loss_cfg=PolicyLossConfig()))


def test_ewma_state_round_trip(ckpt):
    runs = []
    for _ in range(2):
        trainer = HFScorerForTests(ckpt, version=7)
        loop = LoopState()
        strat = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop.context(trainer))
        batch, trajs, _ = drive_history(strat, trainer, loop)
        strat.anchor(batch, trajs)
        trainer.fake_step()
        strat.after_optimizer_step(trainer.version, {})
        runs.append([trainer, loop, strat, batch, trajs])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = Ewma(EwmaConfig(beta=0.5, tau=0.0), runs[1][1].context(runs[1][0]))
        fresh.load_state_dict(runs[0][2].state_dict())
    runs[1][2] = fresh
    out = []
    for trainer, _, strat, batch, trajs in runs:
        trainer.fake_step()
        strat.after_optimizer_step(trainer.version, {})
        out.append(strat.anchor(batch, trajs).logp_anchor)
    assert torch.equal(out[0], out[1])


# ---------------------------------------------------------------- recompute


def test_recompute_is_current_params_forward(ckpt):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Recompute(RecomputeConfig(), loop.context(trainer))
    batch, trajs, _ = drive_history(strat, trainer, loop, extra_step=True)
    res = strat.anchor(batch, trajs)
    assert not res.exact and torch.equal(res.logp_anchor, trainer.logprobs(batch))


# ---------------------------------------------------------------- loglinear / linear


def interp_batch():
    """One row; batch.version = 9 so v_theta = 10. Tokens of v9, v8, v7, v6, and one tool token."""
    versions = torch.tensor([[-1, 9, 8, 7, 6, -1]])
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 0]])
    return TrainBatch(tokens=torch.zeros(1, 7, dtype=torch.long), seq_lens=torch.tensor([7]), loss_mask=mask,
                      logp_behav=torch.tensor([[0.0, -1.0, -1.0, -1.0, -0.5, 0.0]]), versions=versions,
                      advantages=torch.zeros(1, 6), traj_ids=["a"], prompt_lens=torch.tensor([2]), version=9)


def test_alpha_by_hand():
    # alpha = (v_theta - 1 - v_t) / (v_theta - v_t), v_theta = 10:
    #   v_t=9: 0/1 = 0   v_t=8: 1/2   v_t=7: 2/3   v_t=6: 3/4
    alpha = proximal_alpha(interp_batch())
    assert alpha[0, 1:5].tolist() == pytest.approx([0.0, 0.5, 2 / 3, 0.75])


def test_loglinear_by_hand(ckpt):
    batch = interp_batch()
    theta = torch.tensor([[float("nan"), -2.0, -2.0, -2.0, -3.0, float("-inf")]], requires_grad=True)
    res = Loglinear(LoglinearConfig(), LoopState().context(None)).anchor(batch, [])
    assert res.logp_anchor is None and not res.exact
    got = res.from_theta(theta.detach(), batch)
    # behav + alpha (theta - behav): -1 + 0, -1 + 0.5(-1), -1 + (2/3)(-1), -0.5 + 0.75(-2.5); masked -> behav
    assert got[0].tolist() == pytest.approx([0.0, -1.0, -1.5, -5 / 3, -2.375, 0.0])
    assert not got.requires_grad


def test_linear_by_hand():
    batch = interp_batch()
    theta = torch.tensor([[float("nan"), -2.0, -2.0, -2.0, -3.0, float("-inf")]])
    res = Linear(LinearConfig(), LoopState().context(None)).anchor(batch, [])
    got = res.from_theta(theta, batch)

    def mix(a, lb, lt):
        return math.log((1 - a) * math.exp(lb) + a * math.exp(lt) + 1e-10)

    expected = [0.0, mix(0, -1, -2), mix(0.5, -1, -2), mix(2 / 3, -1, -2), mix(0.75, -0.5, -3), 0.0]
    assert expected[1] == pytest.approx(-1.0)  # fresh token: anchor = behav
    assert expected[2] == pytest.approx(-1.379885, abs=1e-6)  # log(0.5 e^-1 + 0.5 e^-2)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)
