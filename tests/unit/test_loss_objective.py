"""The per-step objective (megarl/losses/objective.py): what it accepts as an anchor.

An exact strategy promises the true logp_old at every policy token; a hole in
that anchor is a bug in the strategy and must stop the step, not be trained
around (the loss itself treats a non-finite log-ratio as 0, which is right only
for approximate anchors).
"""
import math

import pytest

from megarl.builder import load_run_config
from megarl.errors import TrainingError
from megarl.losses import PolicyLossConfig
from megarl.losses.objective import loss_fn_factory, loss_fn_factory_for_run
from megarl.types import AnchorResult, TrainBatch, Trajectory

NAN = float("nan")


def batch():
    """Trainer version 5; g3-0: 3 policy tokens of v4, g3-1: 2 of v4, a tool token, 2 of v5."""
    a = Trajectory("g3-0", "g3", [1, 5])
    a.append_policy([6, 7, 8], [-1.0, -1.1, -1.2], [4, 4, 4])
    b = Trajectory("g3-1", "g3", [1, 5, 9])
    b.append_policy([6, 7], [-1.0, -1.1], [4, 4])
    b.append_tool([10])
    b.append_policy([11, 12], [-1.3, -1.4], [5, 5])
    for t in (a, b):
        t.advantage = 1.0
    return TrainBatch.from_trajectories([a, b], version=5)


def anchor_with_hole(tb, row, response_index):
    anchor = tb.logp_behav.clone()
    anchor[tb.loss_mask == 0] = NAN  # holes outside the loss mask are fine
    anchor[row, int(tb.prompt_lens[row]) - 1 + response_index] = NAN
    return anchor


def test_exact_anchor_with_a_nonfinite_policy_token_is_an_error():
    tb = batch()
    anchor = anchor_with_hole(tb, 1, 0)  # g3-1's first response token: policy, version 4
    with pytest.raises(TrainingError) as e:
        loss_fn_factory(PolicyLossConfig(), strategy="snapshot")(tb, AnchorResult(logp_anchor=anchor, exact=True))
    msg = str(e.value)
    assert msg.startswith("recovery strategy 'snapshot' claims an exact logp_old"), msg
    assert "1 policy token(s) of the batch of trainer version 5" in msg, msg
    assert "trajectory 'g3-1', response index 0, sampled by version 4 (value nan)" in msg, msg


def test_exact_anchor_that_is_missing_is_an_error():
    tb = batch()
    with pytest.raises(TrainingError, match=r"interrupt_sync.*no anchor"):
        loss_fn_factory(PolicyLossConfig(), strategy="interrupt_sync")(tb, AnchorResult(logp_anchor=None, exact=True))


def test_exact_anchor_with_holes_only_outside_the_loss_mask_trains():
    tb = batch()
    anchor = tb.logp_behav.clone()
    anchor[tb.loss_mask == 0] = NAN
    tb.logp_anchor = anchor
    loss_fn = loss_fn_factory(PolicyLossConfig(), strategy="snapshot")(tb, AnchorResult(logp_anchor=anchor, exact=True))
    # r = 1, w = 1, A = 1 on all 7 policy tokens: token-mean loss -1
    loss, m = loss_fn(tb.logp_behav.clone().requires_grad_(), tb)
    assert float(loss.detach()) == pytest.approx(-1.0) and m["n_nonfinite_ratio"] == 0


def test_approximate_anchor_keeps_neutralizing_and_counting_nonfinite_tokens():
    tb = batch()
    anchor = anchor_with_hole(tb, 0, 1)
    tb.logp_anchor = anchor
    loss_fn = loss_fn_factory(PolicyLossConfig(), strategy="ewma")(tb, AnchorResult(logp_anchor=anchor, exact=False))
    theta = tb.logp_behav.clone()
    theta[tb.loss_mask > 0] += math.log(1.1)  # r = 1.1 where the anchor is known, 1 (no gradient) at the hole
    loss, m = loss_fn(theta.requires_grad_(), tb)
    assert m["n_nonfinite_ratio"] == 1 and m["n_nonfinite_logratio"] == 1
    assert float(loss.detach()) == pytest.approx(-(6 * 1.1 + 1.0) / 7)


def test_the_run_objective_names_the_configured_strategy():
    cfg = load_run_config(None, ["recovery.name=dedicated"])
    tb = batch()
    with pytest.raises(TrainingError, match="dedicated"):
        loss_fn_factory_for_run(cfg, trainer=None)(tb, AnchorResult(logp_anchor=anchor_with_hole(tb, 0, 0), exact=True))


def test_interpolated_anchor_with_a_kept_denominator_must_come_as_a_tensor():
    # the count of kept tokens depends on the anchor, and a from_theta anchor is known only per micro-batch
    tb = batch()
    cfg = PolicyLossConfig(behav_weight="mis", behav_low=0.5, behav_high=2.0, denominator="kept")
    with pytest.raises(TrainingError, match=r"denominator=kept.*loglinear"):
        loss_fn_factory(cfg, strategy="loglinear")(tb, AnchorResult(None, exact=False, from_theta=lambda lp, mb: lp))
    # with the count of all valid tokens it does not depend on the anchor
    loss_fn = loss_fn_factory(PolicyLossConfig(behav_weight="mis", behav_high=5.0), strategy="loglinear")(
        tb, AnchorResult(None, exact=False, from_theta=lambda lp, mb: lp))
    _, m = loss_fn(tb.logp_behav.clone().requires_grad_(), tb)
    assert m["normalizer"] == 7.0
