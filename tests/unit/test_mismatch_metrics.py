"""The r_d and behaviour-weight metrics on hand-computed numbers (megarl/losses/mismatch.py)."""
import math

import pytest
import torch

from megarl.losses import PolicyLossConfig
from megarl.losses.mismatch import behav_weight_stats, discrepancy

NAN, INF = math.nan, math.inf
# log w = logp_anchor - logp_behav per token: row 0 has w = 1, 0.5, 2; row 1 has w = 0.8, 10; the rest is padding
LOG_W = [[0.0, math.log(0.5), math.log(2.0), 0.0], [math.log(0.8), math.log(10.0), 0.0, 0.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
BEHAV = torch.tensor([[-1.0, -2.0, -0.5, -INF], [-3.0, -4.0, NAN, -INF]])  # padding may hold anything
ANCHOR = BEHAV.nan_to_num(0.0, neginf=0.0) + torch.tensor(LOG_W)


def test_discrepancy_is_mean_and_max_abs_log_r_d_over_known_policy_tokens():
    m = discrepancy(ANCHOR, BEHAV, MASK)
    # |log w| = 0, ln 2, ln 2, ln 1.25, ln 10: sum = ln 5 + ln 10 = ln 50
    assert m["r_d/abs_logp_mean"] == pytest.approx(math.log(50) / 5, rel=1e-6)
    assert m["r_d/abs_logp_max"] == pytest.approx(math.log(10), rel=1e-6)
    assert m["r_d/n_tokens"] == 5
    # logp_old unknown (NaN) at the 10x token: it is left out, not counted as 0
    old = ANCHOR.clone()
    old[1, 1] = NAN
    m = discrepancy(old, BEHAV, MASK)
    assert m["r_d/n_tokens"] == 4
    assert m["r_d/abs_logp_mean"] == pytest.approx(math.log(5) / 4, rel=1e-6)
    assert m["r_d/abs_logp_max"] == pytest.approx(math.log(2), rel=1e-6)
    assert discrepancy(ANCHOR, BEHAV, torch.zeros_like(MASK)) == {}


def test_behav_weight_stats_under_mis_with_a_cap_of_5():
    cfg = PolicyLossConfig(behav_weight="mis", behav_low=None, behav_high=5.0)
    m = behav_weight_stats(ANCHOR, BEHAV, MASK, cfg)
    assert m["behav_w/abs_log_w_max"] == pytest.approx(math.log(10), rel=1e-6)
    assert m["behav_w/masked_frac"] == pytest.approx(1 / 5)  # w = 10 > 5
    assert m["behav_w/downweighted_frac"] == pytest.approx(2 / 5)  # f(w) = w = 0.5 and 0.8
    # sequence log-weights: (0 + ln .5 + ln 2) / 3 = 0 and (ln .8 + ln 10) / 2 = ln 8 / 2
    assert m["behav_w/seq_log_w_std"] == pytest.approx(math.log(8) / 4, rel=1e-6)
    assert m["behav_w/seq_w_min"] == pytest.approx(1.0, rel=1e-6)
    assert m["behav_w/seq_w_max"] == pytest.approx(math.sqrt(8), rel=1e-6)


def test_behav_weight_stats_follow_the_loss_config():
    # IcePop bounds [0.5, 5]: 0.5 stays (bounds inclusive), 10 is masked; f = w
    icepop = behav_weight_stats(ANCHOR, BEHAV, MASK, PolicyLossConfig(behav_weight="mis", behav_low=0.5,
                                                                      behav_high=5.0))
    assert icepop["behav_w/masked_frac"] == pytest.approx(1 / 5)
    # mask only: the kept tokens keep weight 1, nothing is down-weighted
    mask_only = behav_weight_stats(ANCHOR, BEHAV, MASK, PolicyLossConfig(behav_weight="mask", behav_low=0.6,
                                                                         behav_high=5.0))
    assert mask_only["behav_w/masked_frac"] == pytest.approx(2 / 5)  # 0.5 < 0.6 and 10 > 5
    assert mask_only["behav_w/downweighted_frac"] == 0.0
    # no correction at all: nothing masked or weighted, the spread is still reported
    none = behav_weight_stats(ANCHOR, BEHAV, MASK, PolicyLossConfig(behav_weight="none"))
    assert (none["behav_w/masked_frac"], none["behav_w/downweighted_frac"]) == (0.0, 0.0)
    assert none["behav_w/seq_w_max"] == pytest.approx(math.sqrt(8), rel=1e-6)


def test_no_mismatch_gives_the_neutral_values():
    m = behav_weight_stats(BEHAV.nan_to_num(0.0, neginf=0.0), BEHAV, MASK, PolicyLossConfig())
    assert m == {"behav_w/abs_log_w_max": 0.0, "behav_w/masked_frac": 0.0, "behav_w/downweighted_frac": 0.0,
                 "behav_w/seq_log_w_std": 0.0, "behav_w/seq_w_min": 1.0, "behav_w/seq_w_max": 1.0}
