"""Adaptive entropy control in the loop (megarl/losses/entropy_control.py): the real controller and loss factory
move the coefficient after every step from the step's entropy, log the value each step used, skip a skipped step,
and keep the value in the loop's checkpoint. The trainer is the timing simulator of test_staleness_gate.py,
reporting a scripted entropy per step."""
import random

from test_controller_outcomes import loop
from test_staleness_gate import StepCounterTrainerForGateTests

from megarl.losses import PolicyLossConfig
from megarl.losses.objective import loss_fn_factory


class EntropyTrainer(StepCounterTrainerForGateTests):
    """Reports ``entropies[k]`` as the k-th step's mean policy entropy and records each loss's coefficient."""

    def __init__(self, entropies, skip=()):
        super().__init__(random.Random(0), skip)
        self.entropies, self.coefs, self.wanted = list(entropies), [], []

    def train_step(self, batch, loss_fn):
        self.coefs.append(loss_fn.entropy_coef)
        self.wanted.append(loss_fn.wants_entropy)
        out = super().train_step(batch, loss_fn)
        return {**out, "entropy": self.entropies[self.n_calls - 1]}


def test_the_loop_adapts_the_coefficient_logs_it_and_checkpoints_it():
    cfg = PolicyLossConfig(entropy_target=0.5, entropy_coef_step=0.01, entropy_coef_max=0.02)
    factory = loss_fn_factory(cfg)
    trainer = EntropyTrainer([0.1, 0.1, 0.1, 0.9, 0.9], skip={4})
    c, records = loop([], steps=5, trainer=trainer, loss_fn_factory=factory)
    # used by the steps: 0; up after each low entropy (capped at 0.02); down after a high one
    assert trainer.coefs == [0.0, 0.01, 0.02, 0.02, 0.01]
    assert all(trainer.wanted)  # the entropy is computed even while the coefficient is 0
    assert [r["entropy_coef"] for r in records] == trainer.coefs
    # the 5th step was skipped (no optimizer step): its entropy of 0.9 would have moved the value to 0
    assert records[-1]["skipped"] and c.bookkeeping.loss_state() == {"loss": {"entropy_coef": 0.01}}
    # the loop's checkpoint holds it, and a resumed loop goes on with the value it had
    resumed = loss_fn_factory(cfg)
    c.bookkeeping.loss_fn_factory = resumed
    c.bookkeeping.load_loss_state({"loss": {"entropy_coef": 0.015}})
    assert resumed.entropy_control.coef == 0.015
    c.bookkeeping.load_loss_state({})  # a checkpoint from before the control existed: unchanged
    assert resumed.entropy_control.coef == 0.015


def test_a_fixed_coefficient_is_logged_and_never_moves():
    trainer = EntropyTrainer([0.0] * 3)
    factory = loss_fn_factory(PolicyLossConfig(entropy_coef=0.003))
    _, records = loop([], steps=3, trainer=trainer, loss_fn_factory=factory)
    assert trainer.coefs == [0.003] * 3 and [r["entropy_coef"] for r in records] == [0.003] * 3
    trainer = EntropyTrainer([0.0] * 3)
    _, records = loop([], steps=3, trainer=trainer, loss_fn_factory=loss_fn_factory(PolicyLossConfig()))
    assert not any(trainer.wanted) and all("entropy_coef" not in r for r in records)
