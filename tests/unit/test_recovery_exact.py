"""Exact recovery strategies (snapshot, interrupt_sync) and the verifier on hand-built version histories.

The scorer is a real tiny Qwen3 (transformers) whose parameters differ per
version; every exact anchor must equal the per-version forward (verifier) to 1e-6.
"""
import math

import pytest
import torch
from recovery_scorer import HFScorerForTests, LoopState, drive_history, extend, tiny_checkpoint

from megarl.types import TrainBatch, Trajectory
from recovery import verifier
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def trainer(ckpt):
    return HFScorerForTests(ckpt, version=7)


def check_exact(anchor, batch, params, trainer):
    truth = verifier.true_logp_old(batch, params, trainer)
    report = verifier.compare(anchor.logp_anchor, truth, batch)
    assert anchor.exact
    assert report["n_tokens"] == 4 + 6 + 6 + 5
    assert report["n_spliced_sequences"] == 1 and report["max_versions_per_sequence"] == 2
    assert report["max_abs_err"] <= 1e-6, report
    return truth


def test_verifier_versions_really_differ(trainer):
    loop = LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    batch, _, params = drive_history(strat, trainer, loop)
    truth = verifier.true_logp_old(batch, params, trainer)
    with trainer.use_params(params[8]):
        all_v8 = trainer.logprobs(batch)
    v7 = batch.versions == 7
    assert (truth[v7] - all_v8[v7]).abs().max() > 1e-3  # the v7 tokens would be wrong under v8
    assert torch.isnan(truth[batch.loss_mask == 0]).all()
    rep = verifier.compare(all_v8, truth, batch)
    assert rep["max_abs_err"] > 1e-3 and rep["mean_abs_err"] > 0


# ---------------------------------------------------------------- snapshot


@pytest.mark.parametrize("storage,extra_step", [("cpu", False), ("cpu", True), ("disk", True)])
def test_snapshot_exact(trainer, tmp_path, storage, extra_step):
    loop = LoopState()
    # kept copies in another dtype than the parameters' (fp64, exact for these fp32 weights): a swap copies them
    # in, as a GPU trainer's swap of host copies does, instead of pointing at them as it may where they are
    # already on the parameters' device in their dtype (megarl/trainer/param_copies.py)
    keep = trainer.keep_params
    trainer.keep_params = lambda: {k: t.double() for k, t in keep().items()}
    strat = Snapshot(SnapshotConfig(storage=storage), loop.context(trainer, run_dir=tmp_path))
    batch, trajs, params = drive_history(strat, trainer, loop, extra_step=extra_step)
    trainer.forward_rows.clear()
    swaps, copies = trainer.n_swaps, trainer.n_copies
    anchor = strat.anchor(batch, trajs)
    # one forward per version, over only the rows holding it (t0 is spliced: in both)
    assert sorted(map(sorted, trainer.forward_rows)) == [["t0", "t1"], ["t0", "t2"]]
    # the current version (8, when no extra step) is scored without a swap
    assert trainer.n_swaps - swaps == (2 if extra_step else 1)
    # a swap restores the current version from its kept copy where there is one: no copy taken per swap
    assert trainer.n_copies - copies == (0 if storage == "cpu" and not extra_step else trainer.n_swaps - swaps)
    check_exact(anchor, batch, params, trainer)
    over = strat.overhead()
    assert over["versions_held"] == 2 and over["recovery_s"] > 0
    if storage == "disk":
        assert len(list((tmp_path / "snapshots").glob("*.safetensors"))) == 2
        assert over["bytes_moved"] > 0 and over["snapshot_load_s"] > 0
    strat.close()


def test_snapshot_garbage_collection(trainer, tmp_path):
    loop = LoopState()
    strat = Snapshot(SnapshotConfig(storage="disk"), loop.context(trainer, run_dir=tmp_path))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    held = strat.overhead()["bytes_held"]
    assert strat.held_versions == [7, 8] and held > 0
    strat.anchor(batch, trajs)
    loop.live = [t for t in loop.live if t.traj_id != "t1"]  # t1 trained on; t0 (v7+v8) still live
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    assert strat.held_versions == [7, 8]
    loop.live = []  # the whole batch consumed: only the published version stays
    strat.after_optimizer_step(trainer.version, {})
    assert strat.held_versions == [8]
    assert strat.overhead()["bytes_held"] == pytest.approx(held / 2)
    loop.published = 9
    strat.on_weights_published(9)  # publish collects 8 (nothing references it)
    assert strat.held_versions == [9]
    assert [p.name for p in (tmp_path / "snapshots").iterdir()] == ["v9.rank0.safetensors"]
    strat.close()
    assert not list((tmp_path / "snapshots").iterdir())


def test_snapshot_missing_version_is_an_error(trainer):
    loop = LoopState()
    strat = Snapshot(SnapshotConfig(), loop.context(trainer))
    strat.on_weights_published(7)
    t = extend(Trajectory("x", "g", [1, 2]), "policy", 3, 5, seed=0)
    with pytest.raises(RuntimeError, match=r"versions \[5\].*only \[7\]"):
        strat.anchor(TrainBatch.from_trajectories([t], version=7), [t])
    trainer.fake_step()
    with pytest.raises(RuntimeError, match="published while the trainer is at version 8"):
        strat.on_weights_published(9)


@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_snapshot_state_round_trip(ckpt, tmp_path, storage):
    runs = []
    for i in range(2):
        trainer = HFScorerForTests(ckpt, version=7)
        loop = LoopState()
        strat = Snapshot(SnapshotConfig(storage=storage), loop.context(trainer, run_dir=tmp_path / f"r{i}"))
        batch, trajs, _ = drive_history(strat, trainer, loop, extra_step=True)
        runs.append((trainer, loop, strat, batch, trajs))
    (_, _, first, _, _), (_, _, second, _, _) = runs
    fresh = Snapshot(SnapshotConfig(storage=storage), runs[1][1].context(runs[1][0], run_dir=tmp_path / "r2"))
    fresh.load_state_dict(first.state_dict())
    second.close()
    a = first.anchor(runs[0][3], runs[0][4]).logp_anchor
    b = fresh.anchor(runs[1][3], runs[1][4]).logp_anchor
    assert fresh.held_versions == [7, 8]
    assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


# ---------------------------------------------------------------- interrupt_sync


@pytest.mark.parametrize("extra_step", [False, True])
def test_interrupt_sync_exact(trainer, extra_step):
    loop = LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    batch, trajs, params = drive_history(strat, trainer, loop, extra_step=extra_step)
    t0, t1, t2 = trajs
    # before_publish(7, 8) scored every v7 token (finished t1 and the partial t0); v8 tokens wait
    assert not any(math.isnan(x) for x in t1.logp_old)
    assert not any(math.isnan(x) for x in t0.logp_old[:4]) and all(math.isnan(x) for x in t0.logp_old[4:])
    assert strat.overhead()["gen_stall_s"] > 0
    anchor = strat.anchor(batch, trajs)
    check_exact(anchor, batch, params, trainer)
    assert not any(math.isnan(x) for t in trajs for x in t.logp_old)
    assert t1.logp_old[3:5] == [0.0, 0.0]  # tool tokens
    assert strat.overhead()["extra_param_copies"] == 1


def test_interrupt_sync_prescores_only_finished_trajectories(trainer):
    # A multi-turn trajectory between turns: its first turn ended on the tool call (finish_reason "stop",
    # which every turn sets) but the workflow goes on, so the event loop may still append to it while
    # after_optimizer_step runs in the trainer's thread. Only trajectories the loop marked finished are
    # prescored there; the stall of before_publish scores the rest, with everything else of v7.
    loop = LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    loop.published = 7
    strat.on_weights_published(7)
    between = extend(Trajectory("mt", "g0", [1, 5, 2], logp_old=[]), "policy", 3, 7, seed=1)
    between.finish_reason = "stop"
    done = extend(Trajectory("st", "g1", [1, 6, 2], logp_old=[]), "policy", 4, 7, seed=2)
    done.finish_reason, done.finished = "stop", True
    loop.live = [between, done]
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    assert not any(math.isnan(x) for x in done.logp_old)
    assert all(math.isnan(x) for x in between.logp_old), "a trajectory still being generated was scored"
    assert strat.overhead()["prescored_tokens"] == 4
    strat.before_publish(7, 8)
    assert not any(math.isnan(x) for x in between.logp_old)


def test_interrupt_sync_creates_logp_old_and_refuses_lost_versions(trainer):
    loop = LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    loop.published = 7
    strat.on_weights_published(7)
    t = extend(Trajectory("x", "g", [1, 2]), "policy", 3, 7, seed=0)  # logp_old None
    late = extend(Trajectory("y", "g", [1, 2]), "policy", 3, 7, seed=1)
    loop.live = [t]  # `late` is not reported as live: its v7 tokens are lost at the publish
    trainer.fake_step()
    strat.before_publish(7, 8)
    assert len(t.logp_old) == 3 and not any(math.isnan(x) for x in t.logp_old)
    strat.on_weights_published(8)
    with pytest.raises(RuntimeError, match=r"unscored tokens of versions \[7\]"):
        strat.anchor(TrainBatch.from_trajectories([late], version=8), [late])


def test_interrupt_sync_state_round_trip(ckpt):
    runs = []
    for _ in range(2):
        trainer = HFScorerForTests(ckpt, version=7)
        loop = LoopState()
        strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
        runs.append((trainer, loop, strat, *drive_history(strat, trainer, loop, extra_step=True)))
    fresh = InterruptSync(InterruptSyncConfig(), runs[1][1].context(runs[1][0]))
    fresh.load_state_dict(runs[0][2].state_dict())
    a = runs[0][2].anchor(runs[0][3], runs[0][4]).logp_anchor
    b = fresh.anchor(runs[1][3], runs[1][4]).logp_anchor
    assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


# ---------------------------------------------------------------- the verify-recovery check


def verified(strategy, trainer, loop, tol=1e-5):
    """The VerifyingStrategy report of ``strategy`` over the hand-built history (batch version 9)."""
    from recovery.verifier import VerifyingStrategy

    wrapped = VerifyingStrategy(strategy)
    batch, trajs, params = drive_history(wrapped, trainer, loop, extra_step=True)
    wrapped.anchor(batch, trajs)
    return wrapped.report(tol), batch, params


def test_verify_report_measures_exactness(ckpt, trainer):
    from megarl.verify.exactness import failures
    from recovery._negative_controls import NextVersion

    loop = LoopState()
    good, _, _ = verified(Snapshot(SnapshotConfig(), loop.context(trainer)), trainer, loop)
    assert good["claims_exact"] and good["measured_exact"] and good["max_abs_err"] <= 1e-6, good
    assert good["n_tokens"] == 21 and good["tol"] == 1e-5
    # scoring v7 tokens with v8 weights and v8 tokens with the current v9 weights is off by > 1e-3
    other, loop = HFScorerForTests(ckpt, version=7), LoopState()
    bad, _, _ = verified(NextVersion(Snapshot(SnapshotConfig(), loop.context(other))), other, loop)
    assert bad["claims_exact"] and not bad["measured_exact"] and bad["max_abs_err"] > 1e-3, bad
    (line,) = failures({"strategies": {"snapshot": good, "snapshot_next_version": bad}})
    assert line.startswith("snapshot_next_version claims exactness but its max abs error "), line
    assert f"exceeds --tol 1e-05 by {bad['max_abs_err'] - 1e-5:.3g}" in line, line
    # an approximate strategy is never a failure
    assert failures({"strategies": {"x": {**bad, "claims_exact": False}}}) == []


def test_verify_report_gives_both_interpolation_conventions(trainer):
    # batch version 9 (extra step), tokens of v7 and v8. megarl: v_theta = 10, alpha(v8) = 1/2, alpha(v7) = 2/3;
    # areal: v_theta = 9, alpha(v8) = 0, alpha(v7) = 1/2. Each convention's error against the true logp_old
    # is |behav + alpha (theta - behav) - logp_old| over the policy tokens.
    from recovery.loglinear import Loglinear, LoglinearConfig

    loop = LoopState()
    rep, batch, params = verified(Loglinear(LoglinearConfig(convention="areal"), loop.context(trainer)),
                                  trainer, loop)
    assert not rep["claims_exact"] and rep["convention"] == "areal"
    mask = (batch.loss_mask > 0) & (batch.versions >= 0)
    theta, behav = trainer.logprobs(batch), batch.logp_behav
    truth = verifier.true_logp_old(batch, params, trainer)
    for convention, alphas in (("megarl", {8: 0.5, 7: 2 / 3}), ("areal", {8: 0.0, 7: 0.5})):
        alpha = torch.zeros_like(behav)
        for v, a in alphas.items():
            alpha[batch.versions == v] = a
        err = (behav + alpha * (theta - behav) - truth)[mask].abs()
        got = rep["conventions"][convention]
        assert got["max_abs_err"] == pytest.approx(float(err.max()), abs=1e-6), (convention, got)
        assert got["mean_abs_err"] == pytest.approx(float(err.mean()), abs=1e-6), (convention, got)
    # the run trained with areal: its own error is that convention's
    assert rep["max_abs_err"] == rep["conventions"]["areal"]["max_abs_err"]
    assert rep["conventions"]["megarl"]["max_abs_err"] != rep["conventions"]["areal"]["max_abs_err"]
