"""The entropy bonus (``loss.entropy_coef``): the policy's entropy from the real Megatron forward, and the loss term.

Hand-computed entropies for the formula; a real Megatron trainer at the
sampling temperature against transformers' logits for the forward; hand
numbers for the objective. The 2-rank layouts (TP, SP, PP, DP, EP) train with
the bonus in tests/distributed/test_parallel.py.
"""
import math
from pathlib import Path

import pytest
import torch
from recovery_scorer import rewind, tiny_checkpoint

from megarl.builder import build_trainer, load_run_config
from megarl.errors import ConfigError, TrainingError
from megarl.losses import PolicyLossConfig
from megarl.losses.objective import loss_fn_factory
from megarl.models.entropy import vocab_parallel_entropy
from megarl.preflight import validate
from megarl.types import AnchorResult, TrainBatch, Trajectory

REPO = Path(__file__).resolve().parents[2]
T = 0.7


def test_entropy_of_hand_computed_distributions():
    # p = (1/4, 3/4): H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335...; uniform over 4: ln 4; a shift changes nothing
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0 + math.log(3.0)]])
    assert vocab_parallel_entropy(logits).tolist() == pytest.approx([0.5623351446188083] * 2, abs=1e-6)
    assert vocab_parallel_entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4.0), abs=1e-6)


def test_entropy_gradient_equals_autograd_of_the_plain_formula():
    x = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    vocab_parallel_entropy(a).sum().backward()
    p = torch.softmax(b, -1)
    (-(p * torch.log_softmax(b, -1)).sum(-1)).sum().backward()
    assert (a.grad - b.grad).abs().max().item() < 1e-6


def _batch():
    """Two rows: 3 policy tokens; 2 policy tokens, a tool token, 2 policy tokens (7 policy tokens)."""
    a = Trajectory("g-0", "g", [1, 5])
    a.append_policy([6, 7, 8], [-1.0, -1.1, -1.2], [0, 0, 0])
    b = Trajectory("g-1", "g", [1, 5, 9])
    b.append_policy([6, 7], [-1.0, -1.1], [0, 0])
    b.append_tool([10])
    b.append_policy([11, 12], [-1.3, -1.4], [0, 0])
    for t in (a, b):
        t.advantage = 1.0
    tb = TrainBatch.from_trajectories([a, b], version=0)
    tb.logp_anchor = tb.logp_behav.clone()  # what the controller sets from the strategy's anchor
    return tb


def test_the_bonus_subtracts_coef_times_the_mean_entropy_over_policy_tokens():
    tb = _batch()
    entropy = torch.full(tb.loss_mask.shape, 100.0)  # outside the loss mask (prompt, tool, padding): ignored
    entropy[tb.loss_mask > 0] = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])  # sum 14, mean 2
    counts = {"n_valid_tokens": 7.0, "n_seqs": 2.0}
    anchor = AnchorResult(logp_anchor=tb.logp_behav.clone(), exact=True)
    plain = loss_fn_factory(PolicyLossConfig())(tb, anchor)
    bonus = loss_fn_factory(PolicyLossConfig(entropy_coef=0.1))(tb, anchor)
    assert not plain.wants_entropy and bonus.wants_entropy
    base, _ = plain(tb.logp_behav.clone(), tb, counts)
    loss, metrics = bonus(tb.logp_behav.clone(), tb, counts, entropy=entropy)
    assert base.item() == pytest.approx(-1.0)  # ratio 1, advantage 1, token mean
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 14 / 7)
    assert metrics["entropy"] == pytest.approx(2.0)
    # a micro-batch holding row 0 only adds its share of the batch mean: 0.1 * (0.5 + 1 + 1.5) / 7
    part = tb.select([0])
    loss0, _ = bonus(part.logp_behav.clone(), part, counts, entropy=entropy[:1, : part.loss_mask.shape[1]])
    base0, _ = plain(part.logp_behav.clone(), part, counts)
    assert (loss0 - base0).item() == pytest.approx(-0.1 * 3.0 / 7)


def test_the_bonus_without_an_entropy_from_the_trainer_is_an_error():
    tb = _batch()
    fn = loss_fn_factory(PolicyLossConfig(entropy_coef=0.1))(tb, AnchorResult(logp_anchor=tb.logp_behav, exact=True))
    with pytest.raises(TrainingError, match="wants_entropy"):
        fn(tb.logp_behav.clone(), tb, {"n_valid_tokens": 7.0, "n_seqs": 2.0})


def test_adaptive_coefficient_follows_the_target_by_hand():
    from megarl.losses.entropy_control import EntropyControl

    c = EntropyControl(0.0, target=0.2, step=0.001, max_coef=0.0025)
    seen = []
    for h in (0.1, 0.1, 0.1, 0.1, 0.3, float("nan"), None, 0.2, 0.2, 0.2, 0.2):
        c.observe(h)
        seen.append(round(c.coef, 6))
    # below the target: up by the step, capped at the max; at or above it: down, floored at 0;
    # a step without an entropy (nan, None) leaves it
    assert seen == [0.001, 0.002, 0.0025, 0.0025, 0.0015, 0.0015, 0.0015, 0.0005, 0.0, 0.0, 0.0]
    fixed = EntropyControl(0.003)
    fixed.observe(0.0)
    assert fixed.coef == 0.003 and not fixed.adaptive and fixed.active and not EntropyControl(0.0).active
    again = EntropyControl(0.0, target=0.2, step=0.001, max_coef=0.0025)
    again.load_state_dict(c.state_dict() | {"entropy_coef": 0.002})
    assert again.coef == 0.002
    # with a floor: a fixed bonus that rises while the entropy is below the target, never under the floor
    floored = EntropyControl(0.003, target=0.2, step=0.001, max_coef=0.02, min_coef=0.003)
    seen = []
    for h in (0.5, 0.1, 0.1, 0.5, 0.5, 0.5):
        floored.observe(h)
        seen.append(round(floored.coef, 6))
    assert seen == [0.003, 0.004, 0.005, 0.004, 0.003, 0.003]


def test_the_loss_uses_the_adaptive_coefficient_and_observes_at_zero():
    tb = _batch()
    entropy = torch.zeros(tb.loss_mask.shape)
    entropy[tb.loss_mask > 0] = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])  # mean 2
    counts = {"n_valid_tokens": 7.0, "n_seqs": 2.0}
    anchor = AnchorResult(logp_anchor=tb.logp_behav.clone(), exact=True)
    factory = loss_fn_factory(PolicyLossConfig(entropy_target=0.5, entropy_coef_step=0.01, entropy_coef_max=0.1))
    at_zero = factory(tb, anchor)
    assert at_zero.wants_entropy and at_zero.entropy_coef == 0.0  # observed, no bonus yet
    loss, metrics = at_zero(tb.logp_behav.clone(), tb, counts, entropy=entropy)
    assert loss.item() == pytest.approx(-1.0) and metrics["entropy"] == pytest.approx(2.0)
    factory.entropy_control.observe(0.1)  # below the target: the next loss has coefficient 0.01
    nxt = factory(tb, anchor)
    assert nxt.entropy_coef == pytest.approx(0.01)
    loss, _ = nxt(tb.logp_behav.clone(), tb, counts, entropy=entropy)
    assert loss.item() == pytest.approx(-1.0 - 0.01 * 2.0)
    # another trainer rank builds its loss with the coefficient rank 0 used
    given = factory(tb, anchor, entropy_coef=0.05)
    loss, _ = given(tb.logp_behav.clone(), tb, counts, entropy=entropy)
    assert given.entropy_coef == 0.05 and loss.item() == pytest.approx(-1.0 - 0.05 * 2.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def run_cfg(ckpt, *overrides):
    return load_run_config(REPO / "configs" / "tiny_cpu.yaml",
                           [f"model.checkpoint={ckpt}", f"rollout.temperature={T}", *overrides])


def test_a_negative_coefficient_is_refused(ckpt):
    import json

    hf = json.loads((Path(ckpt) / "config.json").read_text())
    with pytest.raises(ConfigError, match="loss.entropy_coef=-0.1 must be >= 0"):
        validate(run_cfg(ckpt, "loss.entropy_coef=-0.1"), hf)
    with pytest.raises(ConfigError, match="loss.entropy_target=0.0 must be > 0"):
        validate(run_cfg(ckpt, "loss.entropy_target=0.0"), hf)
    with pytest.raises(ConfigError, match="loss.entropy_coef=0.003 <= loss.entropy_coef_max=0.001"):
        validate(run_cfg(ckpt, "loss.entropy_target=0.2", "loss.entropy_coef_max=0.001"), hf)
    with pytest.raises(ConfigError, match="loss.entropy_coef_min=0.01 <= loss.entropy_coef=0.003"):
        validate(run_cfg(ckpt, "loss.entropy_target=0.2", "loss.entropy_coef_min=0.01"), hf)


@pytest.fixture(scope="module")
def megatron(ckpt):
    trainer = build_trainer(run_cfg(ckpt, "trainer.lr=1e-2", "trainer.micro_batch_tokens=64"), ckpt)
    return trainer, trainer.get_params()


STEP_BATCH = TrainBatch.from_trajectories(
    [Trajectory("s0", "g", [1, 4, 5], [6, 7, 8, 9, 10, 11], [0.0] * 6, [0] * 6, [1] * 6, advantage=1.0),
     Trajectory("s1", "g", [1, 6], [12, 13, 14, 15, 4], [0.0] * 5, [0] * 5, [1] * 5, advantage=1.0)],
    version=0)


def hf_entropy_at(ckpt, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) of a transformers model at every position, row by row."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for b, n in enumerate(batch.seq_lens.tolist()):
            logp = torch.log_softmax(model(batch.tokens[b: b + 1, :n]).logits[0, :-1].float() / temperature, -1)
            out[b, : n - 1] = -(logp.exp() * logp).sum(-1)
    return out


def _capture_step(trainer, sign: float) -> tuple[torch.Tensor, dict]:
    """One train step whose loss is ``sign`` x the mean entropy over policy tokens; the entropy it was given."""
    seen = {}

    def loss_fn(logp, mb, normalizer, entropy=None):
        for i, tid in enumerate(mb.traj_ids):
            seen[tid] = entropy[i].detach().clone()
        return sign * (entropy * mb.loss_mask).sum() / normalizer["n_valid_tokens"] + 0.0 * logp.sum(), {}

    loss_fn.wants_entropy = True
    metrics = trainer.train_step(STEP_BATCH, loss_fn)
    got = torch.zeros(STEP_BATCH.loss_mask.shape)
    for b, tid in enumerate(STEP_BATCH.traj_ids):
        got[b, : seen[tid].shape[0]] = seen[tid]
    return got, metrics


def test_the_training_forward_gives_the_entropy_at_the_sampling_temperature_with_its_gradient(ckpt, megatron,
                                                                                               tmp_path):
    trainer = rewind(megatron, 0)
    valid = STEP_BATCH.loss_mask > 0
    expected = hf_entropy_at(ckpt, STEP_BATCH, T)
    got, metrics = _capture_step(trainer, -1.0)  # maximize the entropy
    assert metrics["skipped"] == 0.0 and trainer.version == 1
    assert (got - expected)[valid].abs().max().item() <= 1e-5
    # temperature 1 is really different here, so the check above can tell
    assert (hf_entropy_at(ckpt, STEP_BATCH, 1.0) - expected)[valid].abs().max().item() > 0.05
    # the gradient reached the weights: one step up the entropy raised it
    trainer.save_hf_checkpoint(str(tmp_path / "v1"))
    after = hf_entropy_at(tmp_path / "v1", STEP_BATCH, T)
    assert after[valid].mean().item() > got[valid].mean().item() + 1e-3
    # without the flag the model's output is the plain cross entropy again (log-probs unchanged in shape)
    assert trainer.logprobs(STEP_BATCH).shape == STEP_BATCH.loss_mask.shape

