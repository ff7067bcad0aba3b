"""dedicated: a spawned scoring process follows the versions and scores each segment with its own version.

The child here builds HFScorerForTests (``scorer_factory``) to keep the test
fast; test_recovery_megatron.py runs the default MegatronTrainer child.
"""
import math
import time

import pytest
import torch
from recovery_scorer import HFScorerForTests, LoopState, drive_history, extend, tiny_checkpoint

from megarl.types import TrainBatch, Trajectory
from recovery import verifier
from recovery.dedicated import Dedicated, DedicatedConfig

CFG = DedicatedConfig(scorer_factory="recovery_scorer:make_hf_scorer", start_timeout_s=120, wait_timeout_s=120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_dedicated_exact_and_state_round_trip(ckpt, tmp_path):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Dedicated(CFG, loop.context(trainer, run_dir=tmp_path / "a", checkpoint_dir=ckpt))
    fresh = None
    try:
        batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True)
        anchor = strat.anchor(batch, trajs)
        truth = verifier.true_logp_old(batch, params, trainer)
        report = verifier.compare(anchor.logp_anchor, truth, batch)
        assert anchor.exact and report["n_tokens"] == 21 and report["n_spliced_sequences"] == 1
        assert report["max_abs_err"] <= 1e-6, report
        assert not any(math.isnan(x) for t in trajs for x in t.logp_old)
        over = strat.overhead()
        assert over["bytes_moved"] > 0 and over["dedicated_save_s"] > 0
        assert over.get("n_waits", 0) in (0, 1)  # waited only if the child had not caught up
        assert over["pending_segments"] == 0 and over["lag_s"] == 0.0  # the batch's segments are all scored
        assert strat.version == 8
        # the lag is the age of the oldest segment sent and not scored yet
        strat._pending[("late", 0, 1)] = time.perf_counter() - 2.0
        over = strat.overhead()
        del strat._pending[("late", 0, 1)]
        assert over["pending_segments"] == 1 and 2.0 <= over["lag_s"] < 60

        # the trained batch is gone; a new v8 segment is reported; restore into a fresh instance
        loop.live = []
        strat.after_optimizer_step(trainer.version, {})
        t3 = extend(Trajectory("t3", "g2", [1, 4, 4], logp_old=[]), "policy", 5, 8, seed=7)
        loop.live = [t3]
        strat.on_segment_finished(t3)
        state = strat.state_dict()
        assert state["version"] == 8 and len(state["results"]) == 1  # t3 scored, not joined yet
        fresh = Dedicated(CFG, loop.context(trainer, run_dir=tmp_path / "b", checkpoint_dir=ckpt))
        fresh.load_state_dict(state)
        assert fresh.version == 8
        # both continue identically: a new segment of v8 is scored with the restored v8 weights
        outs = []
        for s in (strat, fresh):
            t4 = extend(Trajectory("t4", "g3", [1, 5], logp_old=[]), "policy", 4, 8, seed=8)
            s.on_segment_finished(t4)
            t3c = Trajectory.from_dict(t3.to_dict())
            t3c.logp_old = [math.nan] * 5
            pair = [t3c, t4]
            outs.append(s.anchor(TrainBatch.from_trajectories(pair, version=9), pair).logp_anchor)
        assert torch.equal(torch.nan_to_num(outs[0]), torch.nan_to_num(outs[1]))
        truth = verifier.true_logp_old(TrainBatch.from_trajectories(pair, version=9), params, trainer)
        assert verifier.compare(outs[1], truth, TrainBatch.from_trajectories(pair, version=9))["max_abs_err"] <= 1e-6
    finally:
        strat.close()
        if fresh is not None:
            fresh.close()
    assert not (tmp_path / "a" / "dedicated").exists()


def test_dedicated_segment_reported_too_late_is_an_error(ckpt, tmp_path):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    strat = Dedicated(CFG, loop.context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))
    try:
        strat.on_weights_published(7)
        late = extend(Trajectory("x", "g", [1, 2], logp_old=[]), "policy", 3, 7, seed=0)
        trainer.fake_step()
        strat.on_weights_published(8)  # x's v7 segment was never reported before v8 went out
        strat.on_segment_finished(late)
        with pytest.raises(RuntimeError, match="reported after version 8 was sent"):
            strat.anchor(TrainBatch.from_trajectories([late], version=8), [late])
    finally:
        strat.close()
