"""Tests of megarl.losses.policy_loss: hand-computed special cases, properties, edge cases.

Ratios and weights are set through log-probs: for r = exp(logp_theta - logp_anchor)
and w = exp(logp_anchor - logp_behav) we pick logp_behav, then logp_anchor =
logp_behav + log w and logp_theta = logp_anchor + log r. Expected numbers are worked
out by hand in the comments (eps_clip = 0.2 unless stated).
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.losses import PolicyLossConfig
from megarl.losses.policy import loss_normalizer, policy_loss

INF, NAN = float("inf"), float("nan")
LN = math.log


def make(r, w=None, behav=None, adv=None, mask=None):
    """Build [B, T] tensors from per-token ratios r and weights w (nested lists)."""
    r = torch.tensor(r, dtype=torch.float64)
    w = torch.ones_like(r) if w is None else torch.tensor(w, dtype=torch.float64)
    logp_behav = torch.full_like(r, -1.0) if behav is None else torch.tensor(behav, dtype=torch.float64)
    logp_anchor = logp_behav + w.log()
    logp_theta = (logp_anchor + r.log()).float().requires_grad_(True)
    adv = torch.tensor(adv, dtype=torch.float32)
    mask = torch.ones_like(adv) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return logp_theta, logp_anchor.float(), logp_behav.float(), adv, mask


def run(tensors, cfg, **kw):
    loss, metrics = policy_loss(*tensors, cfg, **kw)
    loss.backward()
    return loss.item(), tensors[0].grad, metrics


def close(x, y, tol=1e-5):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32),
                          atol=tol, rtol=tol)


# ---------------------------------------------------------------- special cases


def test_standard_ppo():
    # anchor = behav, no correction. Four valid tokens and one padded (-inf) position.
    #   t0 r=1.5 A= 1: max(-1.5, -1.2) = -1.2   clipped high, grad 0
    #   t1 r=0.5 A=-1: max( 0.5,  0.8) =  0.8   clipped low,  grad 0
    #   t2 r=1.1 A= 2: max(-2.2, -2.2) = -2.2   inside,       grad -r*A = -2.2
    #   t3 r=0.7 A=-2: max( 1.4,  1.6) =  1.6   clipped low,  grad 0
    # loss = (-1.2 + 0.8 - 2.2 + 1.6) / 4 = -0.25; grad t2 = -2.2 / 4 = -0.55
    t = make([[1.5, 0.5, 1.1, 0.7, 1.0]], adv=[[1.0, -1.0, 2.0, -2.0, 0.0]], mask=[[1, 1, 1, 1, 0]])
    with torch.no_grad():
        t[0][0, 4] = -INF
        t[1][0, 4] = -INF
        t[2][0, 4] = -INF
    loss, grad, m = run(t, PolicyLossConfig())
    assert close(loss, -0.25)
    assert close(grad, [[0.0, 0.0, -0.55, 0.0, 0.0]])
    assert m["clip_frac_low"] == pytest.approx(0.5)  # t1, t3
    assert m["clip_frac_high"] == pytest.approx(0.25)  # t0
    assert m["dual_clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4, rel=1e-5)  # 0.95
    # approx_kl = 0.5 * mean(log r)^2: logs 0.405465, -0.693147, 0.095310, -0.356675,
    # squares 0.164402 + 0.480453 + 0.009084 + 0.127217 = 0.781156 -> 0.5 * 0.781156 / 4 = 0.0976445
    assert m["approx_kl"] == pytest.approx(0.0976445, rel=1e-4)
    assert m["n_valid"] == 4 and m["n_kept"] == 4 and m["active_frac"] == 1.0
    assert m["behav_w_mean"] == pytest.approx(1.0) and m["abs_logp_anchor_minus_behav_mean"] == pytest.approx(0.0)
    assert m["pg_loss"] == pytest.approx(-0.25, rel=1e-5)
    assert m["n_nonfinite_logratio"] == 0 and m["n_nonfinite_ratio"] == 0


def test_areal_decoupled_loss():
    # anchor = logp_prox, w = pi_prox / pi_behav, cap 2 (mis, no lower bound), token-mean over all valid tokens.
    #   t0 w=1.0 r=1.0 A= 1: pg -1,   l = 1.0 * -1   = -1      grad -r*A*w = -1
    #   t1 w=3.0 r=1.0 A= 1: w > cap -> dropped, still counted in the denominator
    #   t2 w=0.5 r=1.3 A= 1: pg max(-1.3, -1.2) = -1.2, l = 0.5 * -1.2 = -0.6   clipped, grad 0
    #   t3 w=1.5 r=0.9 A=-1: pg max(0.9, 0.9) = 0.9, l = 1.5 * 0.9 = 1.35       grad -r*A*w = 1.35
    # loss = (-1 - 0.6 + 1.35) / 4 = -0.0625; grads / 4 = [-0.25, 0, 0, 0.3375]
    t = make([[1.0, 1.0, 1.3, 0.9]], w=[[1.0, 3.0, 0.5, 1.5]], adv=[[1.0, 1.0, 1.0, -1.0]])
    cfg = PolicyLossConfig(behav_weight="mis", behav_high=2.0, agg="token-mean", denominator="all")
    loss, grad, m = run(t, cfg)
    assert close(loss, -0.0625)
    assert close(grad, [[-0.25, 0.0, 0.0, 0.3375]])
    assert m["n_kept"] == 3 and m["active_frac"] == pytest.approx(0.75)
    assert m["behav_w_mean"] == pytest.approx((1 + 3 + 0.5 + 1.5) / 4, rel=1e-5)  # 1.5
    # mean |log w| = (0 + ln 3 + ln 2 + ln 1.5) / 4 = ln 9 / 4 = 0.549306
    assert m["abs_logp_anchor_minus_behav_mean"] == pytest.approx(0.549306, rel=1e-5)
    # the same tokens with denominator "kept": -0.25 / 3
    t = make([[1.0, 1.0, 1.3, 0.9]], w=[[1.0, 3.0, 0.5, 1.5]], adv=[[1.0, 1.0, 1.0, -1.0]])
    loss, _, m = run(t, PolicyLossConfig(behav_weight="mis", behav_high=2.0, denominator="kept"))
    assert close(loss, -0.25 / 3)
    assert m["normalizer"] == 3


def test_icepop():
    # mis with [0.5, 5], r = 1, A = 1 so pg = -1 on every token:
    #   w = 0.4 (out), 0.6 (in), 4.0 (in), 6.0 (out) -> l = [0, -0.6, -4.0, 0]
    # denominator all: -4.6 / 4 = -1.15; kept: -4.6 / 2 = -2.3; grads -w*A/N on kept tokens
    for denominator, n in (("all", 4), ("kept", 2)):
        t = make([[1.0] * 4], w=[[0.4, 0.6, 4.0, 6.0]], adv=[[1.0] * 4])
        cfg = PolicyLossConfig(behav_weight="mis", behav_low=0.5, behav_high=5.0, denominator=denominator)
        loss, grad, m = run(t, cfg)
        assert close(loss, -4.6 / n)
        assert close(grad, [[0.0, -0.6 / n, -4.0 / n, 0.0]])
        assert m["active_frac"] == pytest.approx(0.5)


def test_tis():
    # tis with C = 2, r = 1: weights clamp(w, 0, 2) = [0.5, 2, 1], no token dropped.
    #   pg = [-1, -1, +1] (A = 1, 1, -1) -> l = [-0.5, -2, 1], loss = -1.5 / 3 = -0.5
    t = make([[1.0] * 3], w=[[0.5, 3.0, 1.0]], adv=[[1.0, 1.0, -1.0]])
    loss, grad, m = run(t, PolicyLossConfig(behav_weight="tis", behav_high=2.0))
    assert close(loss, -0.5)
    assert close(grad, [[-0.5 / 3, -2.0 / 3, 1.0 / 3]])
    assert m["active_frac"] == 1.0 and m["n_kept"] == 3
    # with behav_low = 0.8 too: weights [0.8, 2, 1] -> l = [-0.8, -2, 1], loss = -1.8 / 3 = -0.6
    t = make([[1.0] * 3], w=[[0.5, 3.0, 1.0]], adv=[[1.0, 1.0, -1.0]])
    loss, _, _ = run(t, PolicyLossConfig(behav_weight="tis", behav_low=0.8, behav_high=2.0))
    assert close(loss, -0.6)


def _two_sequences():
    # seq0: w = [2, 8] and one padded position (behav -inf): geometric mean sqrt(16) = 4
    # seq1: w = [0.5, 2, 2]: geometric mean (0.5*2*2)^(1/3) = 2^(1/3) = 1.259921
    # r = 1 and A = 1 everywhere: pg = -1 on every valid token
    t = make([[1.0] * 3, [1.0] * 3], w=[[2.0, 8.0, 1.0], [0.5, 2.0, 2.0]], adv=[[1.0] * 3] * 2,
             mask=[[1, 1, 0], [1, 1, 1]])
    with torch.no_grad():
        t[2][0, 2] = -INF
        t[1][0, 2] = NAN
    return t


def test_sequence_level_mask_geometric_mean():
    # mask with behav_high 3, per sequence: seq0 (4 > 3) dropped, seq1 (1.26) kept with weight 1
    # token-mean / all: (-1 * 3) / 5 = -0.6
    cfg = PolicyLossConfig(behav_weight="mask", behav_high=3.0, behav_level="sequence")
    loss, grad, m = run(_two_sequences(), cfg)
    assert close(loss, -0.6)
    assert close(grad, [[0.0, 0.0, 0.0], [-0.2, -0.2, -0.2]])
    assert m["n_kept"] == 3 and m["active_frac"] == pytest.approx(0.6)
    # behav_w_mean uses the sequence w on each valid token: (4 + 4 + 3 * 1.259921) / 5 = 2.355953
    assert m["behav_w_mean"] == pytest.approx(2.355953, rel=1e-5)
    # token-level |log w| is still reported: (ln2 + ln8 + ln2 + ln2 + ln2) / 5 = 7 ln2 / 5 = 0.970406
    assert m["abs_logp_anchor_minus_behav_mean"] == pytest.approx(0.970406, rel=1e-5)
    # the same as token-level: tokens w = 2, 8, 0.5, 2, 2 with [0, 3] -> only 8 dropped: 4 of 5 kept
    _, _, m = run(_two_sequences(), PolicyLossConfig(behav_weight="mask", behav_high=3.0))
    assert m["n_kept"] == 4


def test_sequence_level_mis_and_seq_aggregations():
    gm = 2 ** (1 / 3)  # seq1 weight 1.259921; seq0 dropped (w 4 > 3)
    base = dict(behav_weight="mis", behav_high=3.0, behav_level="sequence")
    # token-mean / all: -3 * 1.259921 / 5 = -0.755953
    loss, _, _ = run(_two_sequences(), PolicyLossConfig(**base))
    assert close(loss, -3 * gm / 5)
    # seq-mean-token-mean / all: seq0 mean 0 / 2 = 0, seq1 mean -1.259921; 2 sequences -> -0.629961
    loss, grad, m = run(_two_sequences(), PolicyLossConfig(**base, agg="seq-mean-token-mean"))
    assert close(loss, -gm / 2)
    assert close(grad[1], [-gm / 6] * 3)  # d/dtheta = -w / (n_s * N_seq) = -1.259921 / 6
    assert m["n_seqs"] == 2
    # seq-mean-token-mean / kept: seq0 has no kept token -> excluded: -1.259921 / 1
    loss, _, m = run(_two_sequences(), PolicyLossConfig(**base, agg="seq-mean-token-mean", denominator="kept"))
    assert close(loss, -gm)
    assert m["n_seqs"] == 1
    # seq-mean-token-sum / all: (0 + -3 * 1.259921) / 2 = -1.889882
    loss, _, _ = run(_two_sequences(), PolicyLossConfig(**base, agg="seq-mean-token-sum"))
    assert close(loss, -3 * gm / 2)


def test_dual_clip():
    # c = 3:
    #   t0 r=5 A=-1: PPO max(5, 1.2) = 5 > 3*|A| -> capped at 3, grad 0
    #   t1 r=2 A=-1: PPO max(2, 1.2) = 2 <= 3     -> 2, grad -r*A = 2
    #   t2 r=5 A= 1: PPO max(-5, -1.2) = -1.2 (clip high; dual clip never touches A > 0), grad 0
    # loss = (3 + 2 - 1.2) / 3 = 1.266667; grads [0, 2/3, 0]
    t = make([[5.0, 2.0, 5.0]], adv=[[-1.0, -1.0, 1.0]])
    loss, grad, m = run(t, PolicyLossConfig(dual_clip=3.0))
    assert close(loss, 3.8 / 3)
    assert close(grad, [[0.0, 2.0 / 3, 0.0]])
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == 0.0
    # without dual clip t0 gives 5: (5 + 2 - 1.2) / 3
    t = make([[5.0, 2.0, 5.0]], adv=[[-1.0, -1.0, 1.0]])
    loss, _, m = run(t, PolicyLossConfig())
    assert close(loss, 5.8 / 3) and m["dual_clip_frac"] == 0.0


def test_asymmetric_clip():
    # eps_clip = 0.2 (low), eps_clip_high = 0.28: r clipped to [0.8, 1.28]
    #   t0 r=1.25 A= 1: -1.25 inside,               grad -1.25
    #   t1 r=1.30 A= 1: max(-1.3, -1.28) = -1.28,   grad 0  (clip_frac_high)
    #   t2 r=0.75 A=-1: max(0.75, 0.8) = 0.8,       grad 0  (clip_frac_low)
    #   t3 r=0.85 A=-1: 0.85 inside,                grad 0.85
    # loss = (-1.25 - 1.28 + 0.8 + 0.85) / 4 = -0.22
    t = make([[1.25, 1.30, 0.75, 0.85]], adv=[[1.0, 1.0, -1.0, -1.0]])
    loss, grad, m = run(t, PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28))
    assert close(loss, -0.22)
    assert close(grad, [[-1.25 / 4, 0.0, 0.0, 0.85 / 4]])
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == pytest.approx(0.25)


def test_anchor_and_behav_get_no_gradient():
    t = list(make([[1.2, 0.9]], w=[[1.5, 0.7]], adv=[[1.0, -1.0]]))
    t[1] = t[1].clone().requires_grad_(True)
    t[2] = t[2].clone().requires_grad_(True)
    t[3] = t[3].clone().requires_grad_(True)
    loss, _ = policy_loss(*t, PolicyLossConfig(behav_weight="mis"))
    loss.backward()
    assert t[1].grad is None and t[2].grad is None and t[3].grad is None


def test_bool_mask_and_bf16_inputs():
    # same tokens as test_standard_ppo, bool mask and bf16 log-probs; the loss is computed in fp32
    r = torch.tensor([[1.5, 0.5, 1.1, 0.7]])
    logp_anchor = torch.full_like(r, -1.0)
    logp_theta = (logp_anchor + r.log()).bfloat16().requires_grad_(True)
    loss, _ = policy_loss(logp_theta, logp_anchor.bfloat16(), logp_anchor.bfloat16(),
                          torch.tensor([[1.0, -1.0, 2.0, -2.0]]), torch.ones(1, 4, dtype=torch.bool),
                          PolicyLossConfig())
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-0.25, abs=2e-2)
    assert torch.isfinite(logp_theta.grad).all()


# ---------------------------------------------------------------- micro-batching


def _random_batch(seed, b, t, frac_masked=0.3):
    g = torch.Generator().manual_seed(seed)
    logp_behav = -torch.rand(b, t, generator=g) * 3
    logp_anchor = logp_behav + torch.randn(b, t, generator=g) * 0.5
    logp_theta = logp_anchor + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > frac_masked).float()
    # padding holds garbage, as in real batches
    logp_theta = torch.where(mask > 0, logp_theta, torch.tensor(-INF))
    logp_behav = torch.where(mask > 0, logp_behav, torch.tensor(NAN))
    adv = torch.where(mask > 0, adv, torch.tensor(NAN))
    return logp_theta, logp_anchor, logp_behav, adv, mask


CFG_VARIANTS = [
    dict(agg="token-mean", denominator="all"),
    dict(agg="seq-mean-token-mean", denominator="all"),
    dict(agg="token-mean", denominator="kept", behav_weight="mis", behav_low=0.6, behav_high=1.5),
    dict(agg="seq-mean-token-mean", denominator="kept", behav_weight="mask", behav_high=1.3),
    dict(agg="seq-mean-token-sum", denominator="all", behav_weight="tis", behav_high=2.0,
         behav_level="sequence"),
]


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 6), t=st.integers(1, 7),
       variant=st.sampled_from(CFG_VARIANTS), n_micro=st.integers(1, 4))
def test_micro_batch_losses_sum_to_full_batch(seed, b, t, variant, n_micro):
    cfg = PolicyLossConfig(**variant)
    logp_theta, logp_anchor, logp_behav, adv, mask = _random_batch(seed, b, t)
    full_theta = logp_theta.clone().requires_grad_(True)
    full, _ = policy_loss(full_theta, logp_anchor, logp_behav, adv, mask, cfg)
    full.backward()

    rows = torch.arange(b).tensor_split(n_micro)
    normalizer = sum(loss_normalizer(logp_anchor[i], logp_behav[i], mask[i], cfg) for i in rows)
    micro_theta = logp_theta.clone().requires_grad_(True)
    total = 0.0
    for i in rows:
        if len(i) == 0:
            continue
        loss, _ = policy_loss(micro_theta[i], logp_anchor[i], logp_behav[i], adv[i], mask[i], cfg,
                              normalizer=normalizer)
        loss.backward()
        total = total + loss.item()
    assert total == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(micro_theta.grad, full_theta.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- properties

any_cfg = st.builds(
    PolicyLossConfig,
    eps_clip=st.sampled_from([0.1, 0.2, 0.3]),
    eps_clip_high=st.sampled_from([None, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    behav_weight=st.sampled_from(["none", "mis", "tis", "mask"]),
    behav_low=st.sampled_from([None, 0.5, 0.9]),
    behav_high=st.sampled_from([None, 1.2, 5.0]),
    behav_level=st.sampled_from(["token", "sequence"]),
    agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    denominator=st.sampled_from(["all", "kept"]),
)


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 5), t=st.integers(1, 6), cfg=any_cfg)
def test_all_masked_gives_zero_loss_and_zero_grad(seed, b, t, cfg):
    logp_theta, logp_anchor, logp_behav, adv, _ = _random_batch(seed, b, t, frac_masked=0.0)
    logp_theta = logp_theta.clone()
    logp_theta[0, 0] = -INF  # garbage under the mask must not matter
    logp_theta.requires_grad_(True)
    loss, m = policy_loss(logp_theta, logp_anchor, logp_behav, adv, torch.zeros(b, t), cfg)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp_theta.grad, torch.zeros(b, t))
    assert m["n_valid"] == 0 and m["n_kept"] == 0 and m["active_frac"] == 1.0


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 5), t=st.integers(1, 6), cfg=any_cfg,
       k=st.floats(0.01, 100.0))
def test_loss_is_linear_in_positive_advantage_scale(seed, b, t, cfg, k):
    logp_theta, logp_anchor, logp_behav, adv, mask = _random_batch(seed, b, t)
    loss, _ = policy_loss(logp_theta, logp_anchor, logp_behav, adv, mask, cfg)
    loss_k, _ = policy_loss(logp_theta, logp_anchor, logp_behav, adv * k, mask, cfg)
    # float32: the loss sums terms of both signs, so round-off is relative to their size, not to the (possibly
    # cancelled) sum; |terms| <= |A| times the largest weight and ratio, a few units here
    size = k * float(torch.where(mask > 0, adv.abs(), torch.zeros(())).sum()) / max(float(mask.sum()), 1.0)
    assert loss_k.item() == pytest.approx(k * loss.item(), rel=1e-4, abs=1e-6 + 1e-5 * size)


@settings(deadline=None, max_examples=50)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 5), t=st.integers(1, 6),
       behav_weight=st.sampled_from(["none", "mis", "tis", "mask"]),
       behav_level=st.sampled_from(["token", "sequence"]),
       denominator=st.sampled_from(["all", "kept"]), dual_clip=st.sampled_from([None, 2.0]))
def test_on_policy_gradient_is_minus_advantage_over_count(seed, b, t, behav_weight, behav_level, denominator,
                                                          dual_clip):
    # theta == anchor == behav: r = w = 1, nothing clipped or masked, so d loss / d logp_theta = -A * mask / N
    cfg = PolicyLossConfig(behav_weight=behav_weight, behav_low=0.5, behav_high=2.0, behav_level=behav_level,
                           denominator=denominator, dual_clip=dual_clip, agg="token-mean")
    _, logp, _, adv, mask = _random_batch(seed, b, t)
    logp_theta = logp.clone().requires_grad_(True)
    loss, m = policy_loss(logp_theta, logp, logp, adv, mask, cfg)
    loss.backward()
    n = max(mask.sum().item(), 1)
    expected = torch.where(mask > 0, -adv, torch.zeros(())) / n
    assert torch.allclose(logp_theta.grad, expected, rtol=1e-5, atol=1e-7)
    assert m["ratio_mean"] == pytest.approx(1.0 if m["n_valid"] else 0.0)


# ---------------------------------------------------------------- non-finite inputs


def test_minus_inf_padding_gives_finite_loss_and_grads():
    logp_theta = torch.tensor([[-0.5, -1.0, -INF, NAN], [-2.0, -INF, -INF, -INF]], requires_grad=True)
    logp_anchor = torch.tensor([[-0.6, -0.9, -INF, NAN], [-2.1, NAN, -INF, -INF]])
    logp_behav = torch.tensor([[-0.7, -1.1, NAN, -INF], [-1.9, -INF, NAN, -INF]])
    adv = torch.tensor([[1.0, -1.0, NAN, INF], [0.5, NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        for behav_weight in ("none", "mis", "tis", "mask"):
            logp_theta.grad = None
            cfg = PolicyLossConfig(agg=agg, behav_weight=behav_weight, behav_level="sequence", dual_clip=3.0)
            loss, m = policy_loss(logp_theta, logp_anchor, logp_behav, adv, mask, cfg)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(logp_theta.grad).all()
            assert all(math.isfinite(v) for v in m.values())
            assert torch.equal(logp_theta.grad[~mask], torch.zeros(5))


def test_nan_advantage_at_valid_position_raises():
    t = make([[1.0, 1.0, 1.0, 1.0]], adv=[[1.0, NAN, INF, NAN]], mask=[[1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"advantages has 2 non-finite values at valid positions"):
        policy_loss(*t, PolicyLossConfig())


def test_nonfinite_logp_theta_at_valid_position_gives_a_nan_loss_that_skips_the_step():
    # a forward that overflowed: the loss is NaN (the trainer skips such a step, reason "non-finite loss"),
    # the bad token is counted and the other metrics stay those of the finite tokens: here t0 alone,
    # r = e^(1 - 1) = 1, A = 1, so pg = -1
    t = make([[1.0, 1.0]], adv=[[1.0, 1.0]])
    with torch.no_grad():
        t[0][0, 1] = -INF
    loss, m = policy_loss(*t, PolicyLossConfig())
    assert math.isnan(loss.item()) and math.isnan(m["pg_loss"])
    assert m["n_nonfinite_logp_theta"] == 1.0 and m["ratio_mean"] == 1.0 and m["n_valid"] == 2.0
    loss.backward()  # still part of the graph: the trainer's backward runs, its non-finite check skips the step
    assert t[0].grad is not None


def test_nonfinite_anchor_or_behav_at_valid_position_is_treated_as_zero_logratio():
    # t0: behav -inf -> log w non-finite -> w = 1 (kept by mis [0.5, 2]); r = 1.5 fine, A = 1 -> clipped: -1.2
    # t1: anchor NaN -> log w and log r non-finite -> w = 1, r = 1 without gradient: l = -A = -1
    # t2: normal token, w = 1, r = 1.1, A = 1: -1.1, grad -1.1
    # loss = (-1.2 - 1 - 1.1) / 3 = -1.1; grads [0, 0, -1.1 / 3]
    t = make([[1.5, 1.0, 1.1]], adv=[[1.0, 1.0, 1.0]])
    with torch.no_grad():
        t[2][0, 0] = -INF
        t[1][0, 1] = NAN
    loss, grad, m = run(t, PolicyLossConfig(behav_weight="mis", behav_low=0.5, behav_high=2.0))
    assert close(loss, -1.1)
    assert close(grad, [[0.0, 0.0, -1.1 / 3]])
    assert m["n_nonfinite_logratio"] == 2 and m["n_nonfinite_ratio"] == 1
    assert m["n_kept"] == 3 and m["behav_w_mean"] == pytest.approx(1.0)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("field", ["behav_weight", "agg", "denominator", "behav_level"])
def test_unknown_config_string_raises(field):
    cfg = PolicyLossConfig(**{field: "bogus"})
    with pytest.raises(ValueError, match=rf"{field}='bogus' is not one of \[") as exc:
        policy_loss(*make([[1.0]], adv=[[1.0]]), cfg)
    assert "'token-mean'" in str(exc.value) or "'none'" in str(exc.value) or "'all'" in str(exc.value) \
        or "'token'" in str(exc.value)


@pytest.mark.parametrize("c", [1.0, 0.5, -2.0])
def test_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match=r"dual_clip=.* must be None or a number c > 1"):
        policy_loss(*make([[1.0]], adv=[[1.0]]), PolicyLossConfig(dual_clip=c))


@pytest.mark.parametrize("kw", [dict(eps_clip=-0.1), dict(eps_clip_high=-0.1), dict(behav_low=-1.0),
                                dict(behav_low=2.0, behav_high=1.0)])
def test_bad_numeric_config_raises(kw):
    with pytest.raises(ValueError, match=r"PolicyLossConfig\."):
        policy_loss(*make([[1.0]], adv=[[1.0]]), PolicyLossConfig(**kw))


def test_shape_mismatch_raises():
    logp_theta, logp_anchor, logp_behav, adv, mask = make([[1.0, 1.0]], adv=[[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"one shape \[B, T\].*'advantages': \(1, 3\)"):
        policy_loss(logp_theta, logp_anchor, logp_behav, torch.ones(1, 3), mask, PolicyLossConfig())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(*(x.reshape(-1) for x in (logp_theta, logp_anchor, logp_behav, adv, mask)),
                    PolicyLossConfig())
