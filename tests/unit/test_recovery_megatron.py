"""Exact strategies against the real MegatronTrainer (CPU, gloo world of one).

Versions are produced by real optimizer steps (Adam, lr 1e-2) on a fixed batch;
the anchor must equal the per-version Megatron forward to 1e-6. The dedicated
strategy runs its default child: a MegatronTrainer in its own gloo world.
Every test runs in float32 and in bfloat16: in bf16 the strategies stay exact
(measured error 0.0) because versions are kept as the bf16 weights themselves
and the dedicated child runs in the trainer's dtype (an fp32 child would be
off by ~3e-3).
"""
import math

import pytest
import torch
from recovery_scorer import LoopState, drive_history, make_traj, rewind, tiny_checkpoint

from megarl.types import TrainBatch
from recovery import verifier
from recovery._stochastic_round import fold_seed
from recovery.dedicated import Dedicated, DedicatedConfig
from recovery.ewma import Ewma, EwmaConfig, ewma_update
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def megatron(ckpt, request):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(str(ckpt), lr=1e-2, micro_batch_tokens=64, dtype=request.param)
    return trainer, trainer.get_params()


@pytest.fixture
def trainer(megatron):
    return rewind(megatron, 7)


STEP_BATCH = TrainBatch.from_trajectories(
    [make_traj("s0", [1, 4, 5], [("policy", 6, 0)], seed=11), make_traj("s1", [1, 6], [("policy", 5, 0)], seed=12)],
    version=0)


def real_step(trainer) -> None:
    def loss_fn(logp, mb, normalizer):
        loss = -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"]
        return loss, {}

    before = trainer.version
    trainer.train_step(STEP_BATCH, loss_fn)
    assert trainer.version == before + 1


def check(anchor, batch, params, trainer):
    truth = verifier.true_logp_old(batch, params, trainer)
    rep = verifier.compare(anchor.logp_anchor, truth, batch)
    assert anchor.exact and rep["n_tokens"] == 21 and rep["n_spliced_sequences"] == 1
    assert rep["max_abs_err"] <= 1e-6, rep
    # the versions really differ: scoring v7 tokens with v8 would be off
    v7 = (batch.versions == 7) & (batch.loss_mask > 0)
    with trainer.use_params(params[8]):
        assert (trainer.logprobs(batch)[v7] - truth[v7]).abs().max() > 1e-4


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_snapshot_megatron(trainer, tmp_path, storage):
    loop = LoopState()
    strat = Snapshot(SnapshotConfig(storage=storage), loop.context(trainer, run_dir=tmp_path))
    batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True, step=real_step)
    check(strat.anchor(batch, trajs), batch, params, trainer)
    strat.close()


def test_kept_copies_reuse_their_buffers(trainer):
    # keep_params fills a reused flat host buffer: a released copy's buffer takes the next one, values of the
    # new version, nothing allocated again
    pool = trainer._host_copies()
    pool.clear()  # the buffers earlier tests' strategies gave back
    first = trainer.keep_params()
    assert all(torch.equal(first[k], v) for k, v in trainer.get_params().items())
    ptrs, allocated = {k: t.data_ptr() for k, t in first.items()}, pool.allocated
    trainer.release_params(first)
    real_step(trainer)
    second = trainer.keep_params()
    assert {k: t.data_ptr() for k, t in second.items()} == ptrs and pool.allocated == allocated
    assert all(torch.equal(second[k], v) for k, v in trainer.get_params().items())
    other = trainer.keep_params()  # while second is held: a buffer of its own
    assert not set(t.data_ptr() for t in other.values()) & set(ptrs.values())
    assert pool.allocated == allocated + 1 and len({t.untyped_storage().data_ptr() for t in other.values()}) == 1
    trainer.release_params(second)
    trainer.release_params(other)


def test_interrupt_sync_megatron(trainer):
    loop = LoopState()
    strat = InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True, step=real_step)
    check(strat.anchor(batch, trajs), batch, params, trainer)
    assert not any(math.isnan(x) for t in trajs for x in t.logp_old)


def test_use_params_points_at_copies_on_the_device_and_restores_the_buffer_views(trainer):
    # a copy on the parameters' device, in their dtype, is pointed at for the forward, not copied in (no saved
    # copy of the shard: ewma's phi_on_gpu costs one shard of GPU memory, not two); afterwards each parameter is
    # its own tensor again (megatron's DDP buffer view), untouched
    module = trainer._module()
    own = {n: (p.data_ptr(), p.detach().clone()) for n, p in module.named_parameters()}
    other = {n: t.mul(1.01) for n, t in trainer.get_params(device=None).items()}
    batch = STEP_BATCH
    plain = trainer.logprobs(batch)
    with trainer.use_params(other):
        assert all(p.data_ptr() == other[n].data_ptr() for n, p in module.named_parameters())
        scored = trainer.logprobs(batch)
    assert all(p.data_ptr() == own[n][0] and torch.equal(p.detach(), own[n][1])
               for n, p in module.named_parameters())
    assert not torch.equal(scored, plain) and torch.equal(trainer.logprobs(batch), plain)
    copied = {n: t.to(torch.float64) for n, t in other.items()}  # another dtype: copied in, as before
    with trainer.use_params(copied):
        assert torch.equal(trainer.logprobs(batch), scored)
    assert all(p.data_ptr() == own[n][0] and torch.equal(p.detach(), own[n][1])
               for n, p in module.named_parameters())


@pytest.mark.parametrize("phi_on_gpu", [False, True])
def test_ewma_megatron(trainer, phi_on_gpu):
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.0, phi_on_gpu=phi_on_gpu), loop.context(trainer))
    batch, trajs, _ = drive_history(strat, trainer, loop, step=real_step)
    strat.anchor(batch, trajs)  # phi <- theta_8
    # phi in the run's dtype: a bf16 run's phi is bf16, its fold rounded stochastically with the draws of the
    # version folded in (recovery/ewma.py); beside it the fp32 average, which a bf16 phi follows within bf16 noise
    dtype = torch.bfloat16 if trainer.dtype == "bfloat16" else torch.float32
    phi, n = ewma_update(None, 0.0, trainer.get_params(), 0.5, dtype=dtype)
    phi32, _ = ewma_update(None, 0.0, trainer.get_params(), 0.5)
    real_step(trainer)
    strat.after_optimizer_step(trainer.version, {})
    gen = torch.Generator()
    gen.manual_seed(fold_seed(0, trainer.version))
    phi, n = ewma_update(phi, n, trainer.get_params(), 0.5, dtype=dtype, generator=gen)
    phi32, _ = ewma_update(phi32, 1.0, trainer.get_params(), 0.5)
    with trainer.use_params(phi):
        expected = trainer.logprobs(batch)
    with trainer.use_params(phi32):
        from_fp32 = trainer.logprobs(batch)
    got = strat.anchor(batch, trajs).logp_anchor
    assert torch.allclose(got, expected, atol=1e-6)
    if dtype == torch.float32:
        assert torch.equal(expected, from_fp32)
    else:  # a bf16 forward's gap between two bf16 roundings of the same average: well under behav's 1e-2 scale
        assert 0 < float((got - from_fp32).abs().max()) < 2e-2


def test_dedicated_megatron_child(trainer, ckpt, tmp_path):
    loop = LoopState()
    cfg = DedicatedConfig(start_timeout_s=180, wait_timeout_s=180)
    strat = Dedicated(cfg, loop.context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))
    try:
        batch, trajs, params = drive_history(strat, trainer, loop, extra_step=True, step=real_step)
        check(strat.anchor(batch, trajs), batch, params, trainer)
        assert strat.state_dict()["version"] == 8
    finally:
        strat.close()
