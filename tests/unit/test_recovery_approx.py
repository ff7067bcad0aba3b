"""Approximate anchors: PPO-EWMA (bias correction, default beta, reset), recompute, loglinear, linear."""
import math
import warnings

import pytest
import torch
from recovery_scorer import HFScorerForTests, LoopState, drive_history, tiny_checkpoint

from megarl.losses import PolicyLossConfig
from megarl.types import TrainBatch
from recovery.ewma import Ewma, EwmaConfig, default_beta, ewma_update
from recovery.linear import Linear, LinearConfig, linear_anchor
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
    for i in range(2):  # as the loop runs: an anchor before every step (each folds the step before it in)
        if i:
            strat.anchor(batch, trajs)
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


def test_ewma_warns_of_a_step_whose_theta_no_anchor_folded(ckpt):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop.context(trainer))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    strat.anchor(batch, trajs)
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})  # the next anchor would fold this theta: nothing missed
    trainer.fake_step()
    with pytest.warns(UserWarning, match="was not folded"):
        strat.after_optimizer_step(trainer.version, {})
    assert strat.n_missed_folds == 1


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
    assert strat.state_dict()["n"] == 1.0  # the step's theta is folded in by the next anchor
    res = strat.anchor(batch, trajs)
    assert res.metrics["ewma/reset"] == 1.0 and res.metrics["ewma/active_frac_pre"] < 0.5
    assert strat.state_dict()["n"] == 1.0 and strat.n_resets >= 1
    # the triggering batch already uses the reset phi = theta
    assert torch.equal(res.logp_anchor, trainer.logprobs(batch))
    assert torch.equal(strat.state_dict()["phi"]["model.embed_tokens.weight"],
                       trainer.get_params()["model.embed_tokens.weight"])
    assert strat.overhead()["n_resets"] >= 1


def test_ewma_without_auto_reset_keeps_its_average_while_the_mask_rejects_tokens(ckpt):
    # the batch of the test above (active fraction < tau) with auto_reset off: the paper's ablation
    tight = PolicyLossConfig(behav_weight="mask", behav_low=0.9, behav_high=1.1)
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.5, auto_reset=False), loop.context(trainer, loss_cfg=tight))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    strat.anchor(batch, trajs)
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    res = strat.anchor(batch, trajs)
    assert res.metrics["ewma/reset"] == 0.0 and res.metrics["ewma/active_frac_pre"] < 0.5
    assert strat.state_dict()["n"] == 1.5 and strat.n_resets == 0
    assert not torch.equal(res.logp_anchor, trainer.logprobs(batch))  # still the average, not theta


def test_ewma_tau_warns_when_nothing_can_be_masked(ckpt):
    with pytest.warns(UserWarning, match="tau=0.5 has no effect"):
        Ewma(EwmaConfig(beta=0.5, tau=0.5), LoopState().context(HFScorerForTests(ckpt), loss_cfg=PolicyLossConfig()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ewma_state_round_trip(ckpt, dtype):
    # bfloat16: phi is bf16 and its folds draw stochastic roundings; the resumed run draws the same ones
    # (seeded by the version folded in), so the anchors agree bit for bit
    runs = []
    for _ in range(2):
        trainer = HFScorerForTests(ckpt, version=7)
        trainer.dtype = dtype
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


def test_alpha_by_hand_areal_convention():
    # AReaL's convention: v_theta = the trainer's version = batch.version = 9; alpha = (8 - v_t) / (9 - v_t),
    # and alpha = 0 where v_t = v_theta (nothing to interpolate):
    #   v_t=9: 0 (v_t = v_theta)   v_t=8: 0/1 = 0   v_t=7: 1/2   v_t=6: 2/3
    # (megarl's convention gives the one-version-old v8 token 1/2 instead of 0)
    alpha = proximal_alpha(interp_batch(), convention="areal")
    assert alpha[0, 1:5].tolist() == pytest.approx([0.0, 0.0, 0.5, 2 / 3])
    assert alpha[0, [0, 5]].tolist() == [0.0, 0.0]  # tool tokens (v = -1) are not interpolated either way


def test_loglinear_and_linear_by_hand_areal_convention():
    batch = interp_batch()
    theta = torch.tensor([[float("nan"), -2.0, -2.0, -2.0, -3.0, float("-inf")]])
    got = Loglinear(LoglinearConfig(convention="areal"), LoopState().context(None)).anchor(batch, []).from_theta(
        theta, batch)
    # behav + alpha (theta - behav), alphas 0, 0, 1/2, 2/3: -1, -1, -1 + (1/2)(-1), -0.5 + (2/3)(-2.5)
    assert got[0].tolist() == pytest.approx([0.0, -1.0, -1.0, -1.5, -0.5 - 5 / 3, 0.0])
    got = Linear(LinearConfig(convention="areal"), LoopState().context(None)).anchor(batch, []).from_theta(
        theta, batch)
    mix = [math.log((1 - a) * math.exp(lb) + a * math.exp(-t) + 1e-10)
           for a, lb, t in ((0, -1, 2), (0, -1, 2), (0.5, -1, 2), (2 / 3, -0.5, 3))]
    assert mix[1] == pytest.approx(-1.0) and mix[2] == pytest.approx(-1.379885, abs=1e-6)
    assert got[0].tolist() == pytest.approx([0.0, *mix, 0.0], abs=1e-6)


def test_convention_is_a_config_field():
    from megarl.builder import load_run_config
    from megarl.errors import ConfigError

    cfg = load_run_config(None, ["recovery.name=linear", "recovery.linear.convention=areal"])
    assert cfg.recovery.options["linear"].convention == "areal"
    assert LoglinearConfig().convention == "megarl" and LinearConfig().convention == "megarl"
    with pytest.raises(ConfigError, match="megarl"):
        load_run_config(None, ["recovery.name=loglinear", "recovery.loglinear.convention=verl"])


# ---------------------------------------------------------------- the kept-token denominator


KEPT = PolicyLossConfig(behav_weight="mis", behav_low=0.5, behav_high=2.0, denominator="kept")


def kept_batch(trainer):
    """Two rows at batch.version 9 (v_theta = 10) whose logp_behav sits c above the model's log-prob.

    loglinear then gives anchor = theta + (1 - alpha) c, so log w = -alpha c and log r = -(1 - alpha) c:
      row 0: v9 c=0.1, v9 c=0.1, v8 c=0.2, v8 c=2.0     row 1: v8 c=-2.0, v8 c=0.2, v8 c=2.0
    """
    from megarl.types import Trajectory

    rows = [([1, 5, 6], [9, 9, 8, 8], [0.1, 0.1, 0.2, 2.0]), ([1, 7], [8, 8, 8], [-2.0, 0.2, 2.0])]
    trajs = []
    for i, (prompt, versions, _) in enumerate(rows):
        t = Trajectory(f"k{i}", "g", prompt)
        t.append_policy([4 + i + j for j in range(len(versions))], [0.0] * len(versions), versions)
        t.advantage = 1.0
        trajs.append(t)
    batch = TrainBatch.from_trajectories(trajs, version=9)
    theta = trainer.logprobs(batch)
    for b, (prompt, _, cs) in enumerate(rows):
        p = len(prompt)
        batch.logp_behav[b, p - 1:p - 1 + len(cs)] = theta[b, p - 1:p - 1 + len(cs)] + torch.tensor(cs)
    return batch, trajs, theta


def test_kept_denominator_counts_the_tokens_the_interpolated_anchor_keeps(ckpt):
    # w = exp(-alpha c), r = exp(-(1 - alpha) c), A = 1, mis bounds [0.5, 2], clip [0.8, 1.2]:
    #   v9 c=0.1 (alpha 0):    w = 1,          r = e^-0.1: kept, l = -e^-0.1
    #   v8 c=0.2 (alpha 1/2):  w = e^-0.1,     r = e^-0.1: kept, l = -e^-0.2
    #   v8 c=2.0:              w = e^-1 = 0.37 < 0.5: dropped
    #   v8 c=-2.0:             w = e^1 = 2.72 > 2:    dropped
    # kept: 2 (v9) + 2 (v8 c=0.2) = 4 of 7 valid tokens;
    # loss = (-2 e^-0.1 - 2 e^-0.2) / 4 = -0.861784 (dividing by 7 would give -0.492448)
    from megarl.losses.objective import loss_fn_factory

    trainer = HFScorerForTests(ckpt, version=9)
    batch, trajs, theta = kept_batch(trainer)
    res = Loglinear(LoglinearConfig(), LoopState().context(trainer, loss_cfg=KEPT)).anchor(batch, trajs)
    if res.logp_anchor is not None:
        batch.logp_anchor = res.logp_anchor
    loss_fn = loss_fn_factory(KEPT)(batch, res)
    total, normalizers = 0.0, []
    for i in range(batch.size):  # one micro-batch per row: their losses must add up to the batch loss
        mb = batch.select([i])
        loss, m = loss_fn(theta[[i], : mb.tokens.shape[1] - 1].clone().requires_grad_(), mb)
        total += float(loss.detach())
        normalizers.append(m["normalizer"])
    assert normalizers == [4.0, 4.0]
    assert total == pytest.approx(-(math.exp(-0.1) + math.exp(-0.2)) / 2, abs=1e-5)
    assert total == pytest.approx(-0.861784, abs=1e-5)


def test_interpolated_anchor_needs_no_forward_when_the_count_does_not_depend_on_it(ckpt):
    trainer = HFScorerForTests(ckpt, version=9)
    batch, trajs, _ = kept_batch(trainer)
    trainer.forward_rows.clear()
    for cfg in (PolicyLossConfig(behav_weight="mis", behav_high=5.0),  # denominator all
                PolicyLossConfig(behav_weight="tis", behav_high=2.0, denominator="kept")):  # tis masks nothing
        res = Linear(LinearConfig(), LoopState().context(trainer, loss_cfg=cfg)).anchor(batch, trajs)
        assert res.logp_anchor is None and res.from_theta is not None
    assert trainer.forward_rows == []
    res = Linear(LinearConfig(), LoopState().context(trainer, loss_cfg=KEPT)).anchor(batch, trajs)
    assert res.from_theta is None and len(trainer.forward_rows) == 1
    assert torch.equal(res.logp_anchor, linear_anchor(trainer.logprobs(batch), batch))
