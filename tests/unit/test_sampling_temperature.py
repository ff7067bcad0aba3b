"""Log-probs at the sampling temperature, and truncated sampling refused for training.

The engines report logp_behav of softmax(logits / T) (vLLM's processed log-probs,
the HF engine's processed_logprobs), so every trainer-side log-prob must be taken
at the same T: the train step, every recovery forward and the dedicated scorer
process. Here the real HF engine samples at T = 0.7 from the same weights as a
real Megatron trainer built from a run config (fp32) whose version history is
made by real optimizer steps and published to the engine; an exact strategy's
logp_old must then equal logp_behav token for token (measured: ~1e-6).
"""
import asyncio
import math
from pathlib import Path

import pytest
import torch
from recovery_scorer import LoopState, rewind, tiny_checkpoint

from megarl.builder import build_trainer, load_run_config
from megarl.errors import ConfigError
from megarl.preflight import validate
from megarl.types import GenerateRequest, SamplingParams, TrainBatch, Trajectory
from recovery.dedicated import Dedicated, DedicatedConfig
from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
from recovery.snapshot import Snapshot, SnapshotConfig

REPO = Path(__file__).resolve().parents[2]
T = 0.7
TOL = 1e-4  # fp32 engine vs fp32 trainer: different kernels, same math


def run_cfg(ckpt, *overrides):
    return load_run_config(REPO / "configs" / "tiny_cpu.yaml",
                           [f"model.checkpoint={ckpt}", f"rollout.temperature={T}", *overrides])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def megatron(ckpt):
    trainer = build_trainer(run_cfg(ckpt, "trainer.lr=1e-2", "trainer.micro_batch_tokens=64"), ckpt)
    return trainer, trainer.get_params()


@pytest.fixture
def trainer(megatron):
    return rewind(megatron, 0)


def hf_logprobs_at(ckpt, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / temperature) of a transformers model, row by row."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = torch.zeros(batch.loss_mask.shape)
    with torch.no_grad():
        for b, n in enumerate(batch.seq_lens.tolist()):
            ids = batch.tokens[b: b + 1, :n]
            logits = model(ids).logits[0, :-1].float() / temperature
            out[b, : n - 1] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out


STEP_BATCH = TrainBatch.from_trajectories(
    [Trajectory("s0", "g", [1, 4, 5], [6, 7, 8, 9, 10, 11], [0.0] * 6, [0] * 6, [1] * 6, advantage=1.0),
     Trajectory("s1", "g", [1, 6], [12, 13, 14, 15, 4], [0.0] * 5, [0] * 5, [1] * 5, advantage=1.0)],
    version=0)


def real_step(trainer) -> None:
    def loss_fn(logp, mb, normalizer):
        return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}

    before = trainer.version
    trainer.train_step(STEP_BATCH, loss_fn)
    assert trainer.version == before + 1


def test_train_step_and_logprobs_score_at_the_sampling_temperature(ckpt, trainer):
    """logp_theta of the train step and trainer.logprobs (every recovery forward) are at T."""
    seen = {}

    def capture(logp, mb, normalizer):
        for i, tid in enumerate(mb.traj_ids):
            seen[tid] = logp[i].detach().clone()
        return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}

    expected = hf_logprobs_at(ckpt, STEP_BATCH, T)
    valid = STEP_BATCH.loss_mask > 0
    from_logprobs = trainer.logprobs(STEP_BATCH)
    trainer.train_step(STEP_BATCH, capture)
    from_step = torch.zeros_like(expected)
    for b, tid in enumerate(STEP_BATCH.traj_ids):
        from_step[b, : seen[tid].shape[0]] = seen[tid]
    assert (from_logprobs - expected)[valid].abs().max() <= 1e-5
    assert (from_step - expected)[valid].abs().max() <= 1e-5
    # temperature 1 is really different on these tokens, so the checks above can tell
    assert (hf_logprobs_at(ckpt, STEP_BATCH, 1.0) - expected)[valid].abs().max() > 0.05


async def _sample(engine, rid: str, prompt: list[int], n: int, seed: int):
    req = GenerateRequest(rid, prompt, SamplingParams(temperature=T, max_new_tokens=n, seed=seed))
    return await engine.generate(req)


async def _history(strategy, trainer, loop: LoopState, engine, tmp_path) -> list[Trajectory]:
    """The loop's hook sequence with the real engine: t0 spliced (v0 then v1), t1 of v0, t2 of v1;
    the trainer ends at version 2, so no token is of the current version."""
    loop.published = 0
    strategy.on_weights_published(0)
    t0 = Trajectory("t0", "g0", [1, 5, 6], logp_old=[])
    t1 = Trajectory("t1", "g0", [1, 7, 8], logp_old=[])
    r0, r1 = await _sample(engine, "t0", t0.prompt_ids, 5, 1), await _sample(engine, "t1", t1.prompt_ids, 8, 2)
    t0.append_policy(r0.output_ids, r0.logp_behav, r0.versions)
    t1.append_policy(r1.output_ids, r1.logp_behav, r1.versions)
    loop.live = [t0, t1]
    strategy.on_segment_finished(t1)
    real_step(trainer)
    strategy.after_optimizer_step(trainer.version, {})
    strategy.on_rollout_interrupted([t0])  # t0 was in flight when v1 was published
    strategy.before_publish(0, 1)
    trainer.save_hf_checkpoint(str(tmp_path / "v1"))
    await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
    loop.published = 1
    strategy.on_weights_published(1)
    r0b = await _sample(engine, "t0", t0.tokens, 6, 3)
    t0.append_policy(r0b.output_ids, r0b.logp_behav, r0b.versions)
    strategy.on_segment_finished(t0)
    t2 = Trajectory("t2", "g1", [1, 9, 9, 9], logp_old=[])
    r2 = await _sample(engine, "t2", t2.prompt_ids, 6, 4)
    t2.append_policy(r2.output_ids, r2.logp_behav, r2.versions)
    loop.live.append(t2)
    strategy.on_segment_finished(t2)
    real_step(trainer)
    strategy.after_optimizer_step(trainer.version, {})
    for t in (t0, t1, t2):
        t.advantage = 1.0
    return [t0, t1, t2]


def _make(name: str, loop: LoopState, trainer, ckpt, tmp_path):
    if name == "snapshot":
        return Snapshot(SnapshotConfig(), loop.context(trainer, run_dir=tmp_path))
    if name == "interrupt_sync":
        return InterruptSync(InterruptSyncConfig(), loop.context(trainer))
    # the default scorer: a MegatronTrainer in its own process, which must be told the temperature
    return Dedicated(DedicatedConfig(start_timeout_s=180, wait_timeout_s=180),
                     loop.context(trainer, run_dir=tmp_path, checkpoint_dir=ckpt))


@pytest.mark.parametrize("name", ["snapshot", "interrupt_sync", "dedicated"])
def test_exact_logp_old_equals_hf_engine_logp_behav_at_temperature(name, ckpt, trainer, tmp_path):
    from megarl.rollout.hf_engine import HFEngine

    loop = LoopState()
    strategy = _make(name, loop, trainer, ckpt, tmp_path)

    async def go():
        engine = await HFEngine.create(str(ckpt), device="cpu")
        try:
            return await _history(strategy, trainer, loop, engine, tmp_path)
        finally:
            await engine.close()

    try:
        trajs = asyncio.run(go())
        assert trajs[0].policy_versions() == {0, 1} and trainer.version == 2
        batch = TrainBatch.from_trajectories(trajs, version=trainer.version)
        anchor = strategy.anchor(batch, trajs)
    finally:
        strategy.close()
    policy = batch.loss_mask > 0
    gap = (anchor.logp_anchor - batch.logp_behav)[policy].abs()
    print(f"\n[temperature {T}] {name}: max |logp_old - logp_behav| = {gap.max():.3g} over {int(policy.sum())} tokens")
    assert anchor.exact and int(policy.sum()) == 5 + 8 + 6 + 6
    assert not math.isnan(float(gap.max())) and gap.max() <= TOL


# -- truncated sampling ------------------------------------------------------------------------------
HF = {"vocab_size": 16, "max_position_embeddings": 128}


@pytest.mark.parametrize("override", ["rollout.top_p=0.9", "rollout.top_k=5"])
def test_truncated_sampling_is_refused_for_training(ckpt, override):
    with pytest.raises(ConfigError, match=r"renormalized truncated distribution[\s\S]*"
                                          r"loss\.allow_truncated_sampling=true"):
        validate(run_cfg(ckpt, override), HF)
    validate(run_cfg(ckpt, override, "loss.allow_truncated_sampling=true"), HF)


def test_sampling_that_keeps_every_token_is_accepted(ckpt):
    validate(run_cfg(ckpt, "rollout.top_p=1.0", "rollout.top_k=-1"), HF)
    validate(run_cfg(ckpt, "rollout.top_k=0"), HF)  # 0 is "off" for the engines too
    validate(run_cfg(ckpt, "rollout.top_k=16"), HF)  # the whole vocabulary: nothing is cut
