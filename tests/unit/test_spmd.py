"""Rank 0's side of several trainer ranks (megarl/loop/spmd.py), in a gloo world of one.

The control channel is the real one (a broadcast to no follower here) that also
keeps what it sent; tests/distributed/test_loop_multirank.py runs real followers.
"""
import math

import pytest
from recovery_scorer import HFScorerForTests, LoopState, extend, tiny_checkpoint

from megarl.loop.spmd import ControlChannel, DrivingStrategy, frozen_copy
from megarl.trainer.parallel import init_distributed
from megarl.types import Trajectory
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


class RecordingChannel(ControlChannel):
    """The control channel, keeping every event it sent; ``after_send(event)`` runs right after a send."""

    def __init__(self):
        init_distributed()
        super().__init__()
        self.sent = []
        self.after_send = None

    def send(self, event):
        super().send(event)
        self.sent.append(event)
        if self.after_send is not None:
            self.after_send(event)


def test_frozen_copy_cuts_an_append_caught_half_way():
    t = Trajectory("t", "g", [1, 2], logp_old=[])
    t.append_policy([5, 6], [-1.0, -2.0], [3, 3])
    t.response_ids.append(7)  # the next append has extended response_ids, not yet the other lists
    c = frozen_copy(t)
    assert (c.response_ids, c.logp_behav, c.versions, c.loss_mask) == ([5, 6], [-1.0, -2.0], [3, 3], [1, 1])
    assert len(c.logp_old) == 2 and c is not t and t.response_ids == [5, 6, 7]


def test_after_optimizer_step_ships_its_inputs_and_rank0_uses_exactly_them(ckpt):
    # interrupt_sync scores finished live trajectories after the optimizer step: a forward, which is a
    # collective with several ranks, so the followers must get the same trajectories and rank 0 must not
    # see a later state (here the event loop finishes `late` right after the event went out)
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    inner = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    channel = RecordingChannel()
    strat = DrivingStrategy(inner, channel)
    loop.published = 7
    strat.on_weights_published(7)
    done = extend(Trajectory("done", "g0", [1, 5, 2], logp_old=[]), "policy", 3, 7, seed=1)
    done.finished = True
    late = extend(Trajectory("late", "g1", [1, 6, 2], logp_old=[]), "policy", 4, 7, seed=2)
    loop.live = [done, late]
    trainer.fake_step()

    def loop_goes_on(event):
        if event[:2] == ("hook", "after_optimizer_step"):
            extend(late, "policy", 2, 7, seed=3)
            late.finished = True

    channel.after_send = loop_goes_on
    strat.after_optimizer_step(8, {})
    event = channel.sent[-1]
    assert event[:3] == ("hook", "after_optimizer_step", (8, {}))
    shipped = {t.traj_id: t for t in event[3]}
    assert shipped["done"] is done, "a finished trajectory no longer changes: sent as it is"
    assert shipped["late"] is not late and len(shipped["late"].response_ids) == 4 and not shipped["late"].finished
    # rank 0 scored what a follower scores from the shipped list: `done` only
    assert not any(math.isnan(x) for x in done.logp_old)
    assert all(math.isnan(x) for x in late.logp_old)
    assert inner.overhead()["prescored_tokens"] == 3
    assert inner.ctx.live_trajectories() == [done, late], "the pinned view ends with the hook"
    assert channel.sent[-2][0] == "hooks" and channel.sent[-2][2] == {7}  # live versions go first


def test_strategy_that_never_reads_live_trajectories_ships_none(ckpt, tmp_path):
    trainer = HFScorerForTests(ckpt, version=7)
    loop = LoopState()
    channel = RecordingChannel()
    strat = DrivingStrategy(Snapshot(SnapshotConfig(), loop.context(trainer, run_dir=tmp_path)), channel)
    loop.live = [extend(Trajectory("a", "g0", [1, 5, 2]), "policy", 3, 7, seed=1)]
    loop.published = 7
    strat.on_weights_published(7)
    trainer.fake_step()
    strat.after_optimizer_step(8, {})
    assert [e[3] for e in channel.sent if e[0] == "hook"] == [None, None]


def test_followers_export_without_host_copies():
    """A follower rank only takes part in the export's gathers and discards what it yields: it asks for
    the tensors where they are (on a GPU trainer: no device -> host copy of the whole model per rank)."""
    import torch

    from megarl.loop.follower import FollowerView, follow

    calls = []

    class Trainer:
        def export_hf_weights(self, **kw):
            calls.append(kw)
            return iter([("w", torch.zeros(2))])

    class Channel:
        events = [("export_hf_weights",), ("stop",)]

        def recv(self):
            return self.events.pop(0)

    follow(Trainer(), None, Channel(), None, FollowerView())
    assert calls == [{"to_host": False}]


def test_a_follower_builds_its_loss_with_the_entropy_coefficient_rank_0_sent():
    """A train_step event carries the entropy coefficient rank 0's loss used; None (a loss without one) calls
    the factory as (batch, anchor) alone, so a factory of that older form keeps working."""
    from megarl.loop.follower import FollowerView, follow

    built, trained = [], []

    class Trainer:
        def train_step(self, batch, loss_fn):
            trained.append(loss_fn)

    class Channel:
        events = [("train_step", 0.004), ("train_step", None), ("stop",)]

        def recv(self):
            return self.events.pop(0)

    def factory(batch, anchor, **kw):
        built.append(kw)
        return len(built)

    follow(Trainer(), None, Channel(), factory, FollowerView())
    assert built == [{"entropy_coef": 0.004}, {}] and trained == [1, 2]
    Channel.events = [("train_step", None), ("stop",)]
    follow(Trainer(), None, Channel(), lambda batch, anchor: "two-argument factory", FollowerView())
    assert trained[-1] == "two-argument factory"


def test_export_on_the_device_copies_nothing(ckpt):
    """``to_host=False``: the same tensors as the host export, and the unsharded ones are the parameters'
    own storage (nothing materialized); ``to_host=True`` gives copies of their own."""
    import torch

    from megarl.models.bridge import export_hf_weights
    from megarl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(str(ckpt), micro_batch_tokens=48)
    params = {p.data_ptr() for chunk in trainer.model for p in chunk.parameters()}
    kept = list(export_hf_weights(trainer.model, trainer.hf_config, trainer.config, to_host=False))
    host = list(trainer.export_hf_weights())
    assert [n for n, _ in kept] == [n for n, _ in host]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(kept, host))
    norm = "model.norm.weight"
    assert dict(kept)[norm].data_ptr() in params and dict(host)[norm].data_ptr() not in params
