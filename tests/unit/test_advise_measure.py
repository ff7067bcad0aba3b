"""`megarl advise`'s per-batch measurements on hand-made batches, with hand-computed numbers."""
from __future__ import annotations

import math

import numpy as np
import torch

from megarl.advise.measure import Accumulator, clipped, decade_hist, distribution, length_bin
from megarl.losses import PolicyLossConfig
from megarl.types import NO_VERSION, TrainBatch


def _batch(versions, behav, adv, version=3):
    versions = torch.tensor(versions, dtype=torch.long)
    mask = (versions != NO_VERSION).float()
    b, t = versions.shape
    return TrainBatch(tokens=torch.zeros(b, t + 1, dtype=torch.long), seq_lens=torch.full((b,), t + 1),
                      loss_mask=mask, logp_behav=torch.tensor(behav), versions=versions,
                      advantages=torch.tensor(adv), traj_ids=[str(i) for i in range(b)], version=version)


def test_clipped_marks_exactly_the_tokens_whose_ratio_leaves_the_clip_range_on_the_side_of_their_advantage():
    # logp_theta - anchor = log r: r = 1.5 (A>0 clipped, A<0 not), r = 0.5 (A<0 clipped, A>0 not), r = 1.1 never
    lr = [math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.1), math.log(1.5)]
    batch = _batch([[3, 3, 3, 3, 3, NO_VERSION]], [[0.0] * 6], [[1.0, -1.0, -1.0, 1.0, 1.0, 1.0]])
    theta = torch.tensor([lr])
    got = clipped(theta, torch.zeros(1, 6), batch, PolicyLossConfig(eps_clip=0.2))
    assert got.tolist() == [[True, False, True, False, False, False]]  # the padded token is never counted
    # a wider upper clip (0.6) releases r = 1.5 with A > 0
    wide = clipped(theta, torch.zeros(1, 6), batch, PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.6))
    assert wide.tolist() == [[False, False, True, False, False, False]]
    # dual clip c = 3: r = 4 with A < 0 is past the cap (loss capped at 3|A|): no gradient either
    dual = _batch([[3]], [[0.0]], [[-1.0]])
    assert clipped(torch.tensor([[math.log(4.0)]]), torch.zeros(1, 1), dual,
                   PolicyLossConfig(eps_clip=0.2, dual_clip=3.0)).tolist() == [[True]]
    assert clipped(torch.tensor([[math.log(4.0)]]), torch.zeros(1, 1), dual,
                   PolicyLossConfig(eps_clip=0.2)).tolist() == [[False]]


def test_the_train_inference_weight_does_not_change_which_tokens_are_clipped():
    # w = exp(anchor - behav) = e^3 is far above behav_high: the mis mask drops both tokens from the loss, but the
    # clip decision is the trust region's alone: r = 1.5 (A > 0) is clipped, r = 1 is not
    batch = _batch([[3, 3]], [[-3.0, -3.0]], [[1.0, 1.0]])
    cfg = PolicyLossConfig(eps_clip=0.2, behav_weight="mis", behav_high=2.0)
    theta = torch.tensor([[math.log(1.5), 0.0]])
    assert clipped(theta, torch.zeros(1, 2), batch, cfg).tolist() == [[True, False]]


def test_distribution_bins_and_decades():
    d = distribution(np.array([1.0, 2.0, 3.0, 4.0]))
    assert (d["mean"], d["p50"], d["max"], d["n"]) == (2.5, 2.5, 4.0, 4)
    assert abs(d["p99"] - 3.97) < 1e-9  # linear interpolation: 1 + 0.99 * 3
    assert distribution(np.zeros(0))["n"] == 0
    assert [length_bin(n) for n in (1, 4, 5, 8, 9, 5000)] == ["1-4", "1-4", "5-8", "5-8", "9-16", ">4096"]
    h = decade_hist(np.array([0.0, 5e-9, 2e-3, 0.5, 3.0]))
    assert h["<1e-08"] == 2 and h["1e-03"] == 1 and h["1e-01"] == 1 and h[">=1e+00"] == 1
    assert sum(h.values()) == 5


def test_accumulator_summarizes_gap_rule_staleness_and_each_anchors_distance():
    # two rows at trainer version 3: row 0 sampled by v3, v3, v2 (spliced), row 1 by v1 and one padded token
    batch = _batch([[3, 3, 2], [1, 1, NO_VERSION]], [[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0]],
                   [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    truth = torch.tensor([[-1.0, -1.1, -0.2], [-2.0, -2.0, float("nan")]])
    theta = truth.clone()
    theta[0, 2] = truth[0, 2] + math.log(2.0)  # r = 2 against the exact anchor at a stale token: clipped (A > 0)
    anchors = {"behav": batch.logp_behav, "recompute": theta}
    acc = Accumulator(PolicyLossConfig(eps_clip=0.2, behav_weight="mis", behav_high=2.0))
    acc.add(batch, truth, theta, anchors)
    s = acc.summary()
    # gaps |truth - behav| over the 5 policy tokens: 0, 0.1, 0.8, 0, 0
    assert s["gap"]["n"] == 5 and abs(s["gap"]["mean"] - 0.18) < 1e-6 and abs(s["gap"]["max"] - 0.8) < 1e-6
    assert s["gap"]["seq_sum_by_length"]["1-4"]["n_sequences"] == 2
    assert abs(s["gap"]["seq_sum_by_length"]["1-4"]["max"] - 0.9) < 1e-6
    # w = exp(0.8) = 2.23 > 2 masks one token of five; none is kept with f(w) < 0.9 (w = e^-0.1 = 0.905)
    assert s["rule"]["masked_frac"] == 0.2 and s["rule"]["downweighted_frac"] == 0.0
    st = s["staleness"]
    assert st["lag_hist"] == {"0": 2, "1": 1, "2": 2} and abs(st["lag_mean"] - 1.0) < 1e-9
    assert st["spliced_frac"] == 0.5 and st["versions_per_sequence"] == {"1": 1, "2": 1}
    # the exact anchor clips 1 of 5 tokens (the r = 2 one); recompute's anchor is theta itself: r = 1, clips none
    assert s["exact_clipped_frac"] == 0.2
    assert s["anchors"]["recompute"]["clip_differs_frac"] == 0.2
    assert abs(s["anchors"]["recompute"]["max"] - math.log(2.0)) < 1e-6
    # behav's anchor at that token is -1.0: r = exp(-0.2 + log 2 + 1.0) = 4.45, clipped like the exact one
    assert s["anchors"]["behav"]["clip_differs_frac"] == 0.0
    assert abs(s["anchors"]["behav"]["mean"] - 0.18) < 1e-6
