"""bf16 training on the real megatron-core stack (CPU, gloo, one rank): mixed precision, log-probs, engines.

Tolerance of the log-prob comparisons. bf16 keeps 8 significant bits
(``torch.finfo(torch.bfloat16).eps`` = 2^-7), so logits carry relative errors
of that order and the error of a log-prob grows with its magnitude. Measured on
the tiny dense and MoE models (3 batches each): |bf16 - fp32 trainer| max
0.002-0.005 where log-probs reach -3.3 (random init), 0.019 where they reach
-7.5 (embeddings scaled x4), 0.10 at -30 (x16); teacher-forced megatron bf16
against HF bf16 (the engine's precision) 0.003, 0.036 and 0.14, and on the
tokens the bf16 HF engine samples in the test below 0.003 (x1) and 0.007 (x4).
The tests allow one bf16 eps times the largest |log-prob| of the batch (0.026
and 0.058 for the two models used here): 1.6-8x above what was measured, and a
bug that changes the model (a wrong weight, a layer skipped) moves log-probs
by far more.
"""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from megarl.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
BF16_EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """A tiny dense Qwen3 (random init) and the same model with embeddings x4 (sharper, realistic log-probs)."""
    from safetensors.torch import load_file, save_file

    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("bf16")
    base = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", root / "x1", seed=1)
    sharp = root / "x4"
    shutil.copytree(base, sharp)
    tensors = {k: v * 4.0 if "embed_tokens" in k else v for k, v in load_file(base / "model.safetensors").items()}
    save_file(tensors, str(sharp / "model.safetensors"), metadata={"format": "pt"})
    return {"x1": str(base), "x4": str(sharp)}


def trainer_for(ckpt, **kw):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    kw.setdefault("micro_batch_tokens", 48)
    return MegatronTrainer(ckpt, **kw)


def make_batch(seed: int = 0):
    from test_parity_hf import make_batch as parity_batch

    return parity_batch(seed)


def nll(logp, mb, normalizer):
    return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}


def inner_optimizers(trainer) -> list:
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def main_params(trainer) -> list[torch.Tensor]:
    """The parameters the torch optimizer updates (megatron's fp32 main params under bf16)."""
    return [p for o in inner_optimizers(trainer) for g in o.optimizer.param_groups for p in g["params"]]


# -- mixed precision ---------------------------------------------------------------------------
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_bf16_trainer_keeps_fp32_main_params_and_learns(ckpts, distributed_optimizer):
    from megatron.core.transformer.module import Float16Module

    trainer = trainer_for(ckpts["x1"], dtype="bfloat16", lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    assert trainer.dtype == "bfloat16" and trainer.config.bf16 and trainer.config.params_dtype is torch.bfloat16
    assert isinstance(trainer.model[0].module, Float16Module)
    model_params = list(trainer._module().parameters())
    assert {p.dtype for p in model_params} == {torch.bfloat16}
    assert {b.grad_dtype for b in trainer.model[0].buffers} == {torch.float32}  # grad_reduce_in_fp32
    batch = make_batch()
    losses = []
    for _ in range(4):
        m = trainer.train_step(batch, nll)
        assert m["skipped"] == 0.0 and all(map(torch.isfinite, torch.tensor([m["loss"], m["grad_norm"]]))), m
        losses.append(m["loss"])
    print(f"\n[bf16] distributed_optimizer={distributed_optimizer} loss: {[round(x, 4) for x in losses]}")
    assert losses[-1] < losses[0] - 0.05, losses
    assert trainer.version == 4
    kind = "DistributedOptimizer" if distributed_optimizer else "Float16OptimizerWithFloat16Params"
    assert [type(o).__name__ for o in inner_optimizers(trainer)] == [kind]
    mains = main_params(trainer)
    assert {p.dtype for p in mains} == {torch.float32}
    assert sum(p.numel() for p in mains) == sum(p.numel() for p in model_params)
    # the updates below bf16 resolution live on in the main params
    assert any(not torch.equal(p, p.bfloat16().float()) for p in mains)
    assert {p.dtype for p in model_params} == {torch.bfloat16}
    if not distributed_optimizer:  # the model holds the main params rounded to bf16
        (o,) = inner_optimizers(trainer)
        for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups, strict=True):
            assert all(torch.equal(p, mp.bfloat16()) for p, mp in zip(model_group, main_group, strict=True))


def test_bf16_logprobs_are_fp32_log_softmax_of_the_bf16_logits(ckpts):
    trainer = trainer_for(ckpts["x4"], dtype="bfloat16")
    batch = make_batch()
    got = trainer.logprobs(batch)
    assert got.dtype == torch.float32
    tokens = batch.tokens
    n = tokens.shape[1] - 1
    with torch.no_grad():
        logits = trainer.model[0](input_ids=tokens[:, :-1], position_ids=torch.arange(n).expand(tokens.shape[0], n),
                                  attention_mask=None)
    assert logits.dtype == torch.float32  # Float16Module hands the last stage's bf16 outputs back as fp32
    target = tokens[:, 1:, None]
    want = torch.log_softmax(logits.float(), -1).gather(-1, target)[..., 0]
    in_bf16 = torch.log_softmax(logits.bfloat16(), -1).float().gather(-1, target)[..., 0]
    mask = batch.loss_mask > 0
    assert (got - want).abs()[mask].max() < 1e-5
    # a log-softmax in bf16 would be visibly off: the check above tells them apart
    assert (in_bf16 - want).abs()[mask].max() > 1e-3


@pytest.mark.parametrize("model", ["x1", "x4"])
def test_bf16_logprobs_match_fp32_trainer_and_bf16_hf_engine(ckpts, model, tmp_path):
    from megarl.rollout.hf_engine import HFEngine
    from megarl.types import GenerateRequest, SamplingParams, TrainBatch, Trajectory

    bf16, fp32 = trainer_for(ckpts[model], dtype="bfloat16"), trainer_for(ckpts[model])
    batch = make_batch()
    mask = batch.loss_mask > 0
    ref = fp32.logprobs(batch)
    tol = BF16_EPS * float(ref[mask].abs().max())  # the model's log-prob scale (module doc)
    got = bf16.logprobs(batch)
    gap = (got - ref).abs()[mask]
    print(f"\n[bf16] {model}: |bf16 - fp32 trainer| max {gap.max():.4f} mean {gap.mean():.5f} (tol {tol:.4f})")
    assert gap.max() <= tol
    # the same weights exactly (the bf16 ones, in fp32): what is left is bf16 arithmetic
    bf16.save_hf_checkpoint(str(tmp_path / "rounded"))
    gap = (got - trainer_for(str(tmp_path / "rounded")).logprobs(batch)).abs()[mask]
    print(f"[bf16] {model}: |bf16 - fp32 trainer on the bf16 weights| max {gap.max():.4f} mean {gap.mean():.5f}")
    assert gap.max() <= tol

    async def generate():
        engine = await HFEngine.create(ckpts[model], dtype="bfloat16")
        try:
            assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
            return [await engine.generate(GenerateRequest(f"r{i}", [1, 5 + i, 6, 7],
                                                          SamplingParams(temperature=1.0, seed=i,
                                                                         max_new_tokens=20)))
                    for i in range(4)]
        finally:
            await engine.close()

    results = asyncio.run(generate())
    trajs = [Trajectory(traj_id=r.request_id, group_id="", prompt_ids=[1, 5 + i, 6, 7], response_ids=r.output_ids,
                        logp_behav=r.logp_behav, versions=r.versions, loss_mask=[1] * len(r.output_ids))
             for i, r in enumerate(results)]
    gen = TrainBatch.from_trajectories(trajs, version=0)
    gmask = gen.loss_mask > 0
    gap = (bf16.logprobs(gen) - gen.logp_behav).abs()[gmask]
    print(f"[bf16] {model}: |megatron bf16 - HF engine bf16| max {gap.max():.4f} mean {gap.mean():.5f} "
          f"(tol {tol:.4f}, {int(gmask.sum())} tokens)")
    assert gap.max() <= tol


# -- weights out and back in --------------------------------------------------------------------
def test_bf16_export_and_reload(ckpts, tmp_path):
    from safetensors.torch import load_file

    from megarl.rollout.base import resolve_dtype

    trainer = trainer_for(ckpts["x1"], dtype="bfloat16")
    original = load_file(Path(ckpts["x1"]) / "model.safetensors")
    streamed = dict(trainer.export_hf_weights())
    assert set(streamed) == set(original) and {t.dtype for t in streamed.values()} == {torch.bfloat16}
    # loading rounds the fp32 checkpoint to bf16 and exporting gives exactly that back
    assert all(torch.equal(streamed[k], original[k].bfloat16()) for k in original)
    out = tmp_path / "saved"
    trainer.save_hf_checkpoint(str(out))
    saved = load_file(out / "model.safetensors")
    assert all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], streamed[k]) for k in streamed)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and resolve_dtype("auto", config) == "bfloat16"
    reloaded = trainer_for(str(out), dtype="bfloat16")
    a, b = trainer.get_params(), reloaded.get_params()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the broadcast publisher's disk copy (what a restarted engine loads) is the same checkpoint
    import asyncio

    from megarl.rollout.publish import BroadcastPublisher

    async def publish_copy():
        publisher = BroadcastPublisher(trainer, None, tmp_path / "weights")
        await publisher.prepare(1)
        await publisher.wait_written()  # the copy is written in the background; its readers wait for it

    asyncio.run(publish_copy())
    copy = tmp_path / "weights" / "v1"
    assert json.loads((copy / "config.json").read_text()) == config
    assert load_file(copy / "model.safetensors").keys() == saved.keys()
    assert all(torch.equal(load_file(copy / "model.safetensors")[k], saved[k]) for k in saved)


def test_engine_dtype_resolution(tmp_path):
    from megarl.cli import build_parser
    from megarl.rollout.base import resolve_dtype

    assert resolve_dtype("auto", {"dtype": "bfloat16"}) == "bfloat16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}) == "float32"  # transformers < 5 spelling
    assert resolve_dtype("auto", {}) == "float32"
    assert resolve_dtype("bfloat16", {"dtype": "float32"}) == "bfloat16"
    args = build_parser().parse_args(["engine", "--checkpoint", str(tmp_path), "--backend", "hf",
                                      "--dtype", "bfloat16"])
    assert args.dtype == "bfloat16"
    assert build_parser().parse_args(["engine", "--checkpoint", str(tmp_path)]).dtype is None


def test_dtype_is_validated(ckpts):
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match="float16"):
        trainer_for(ckpts["x1"], dtype="float16")


# -- resume ------------------------------------------------------------------------------------
def test_bf16_state_round_trip_is_bitwise(ckpts, tmp_path):
    """save_state/load_state carry the bf16 model and the fp32 main params: the resumed step is identical."""
    batch = make_batch()
    a = trainer_for(ckpts["x1"], dtype="bfloat16", lr=1e-2, lr_warmup_steps=3)
    a.train_step(batch, nll)
    a.train_step(batch, nll)
    a.save_state(str(tmp_path / "state"))
    mains_saved = [p.clone() for p in main_params(a)]
    loss_a = a.train_step(batch, nll)["loss"]
    want, want_mains = a.get_params(), [p.clone() for p in main_params(a)]

    b = trainer_for(ckpts["x1"], dtype="bfloat16", lr=1e-2, lr_warmup_steps=3)
    b.load_state(str(tmp_path / "state"))
    assert b.version == 2
    assert all(torch.equal(x, y) for x, y in zip(mains_saved, main_params(b), strict=True))
    loss_b = b.train_step(batch, nll)["loss"]
    got = b.get_params()
    assert loss_a == loss_b and b.version == 3
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(x, y) for x, y in zip(want_mains, main_params(b), strict=True))
    assert {p.dtype for p in b._module().parameters()} == {torch.bfloat16}

    fp32 = trainer_for(ckpts["x1"], lr=1e-2)
    with pytest.raises(CheckpointError, match="written by a bfloat16 trainer; this trainer is float32"):
        fp32.load_state(str(tmp_path / "state"))


def test_bf16_copies_of_a_version_are_bf16_and_exact(ckpts):
    """A kept version (snapshot, interrupt_sync) is the weights the forward uses: bf16 on a bf16 trainer, half an
    fp32 copy, and scoring with it after the weights moved on gives that version's log-probs bitwise."""
    from recovery._scoring import params_nbytes

    trainer = trainer_for(ckpts["x1"], dtype="bfloat16", lr=1e-2)
    batch = make_batch()
    kept, before = trainer.get_params(), trainer.logprobs(batch)
    assert {t.dtype for t in kept.values()} == {torch.bfloat16}
    assert params_nbytes(kept) == sum(p.numel() for p in trainer._module().parameters()) * 2
    trainer.train_step(batch, nll)
    assert not torch.equal(trainer.logprobs(batch), before)  # the weights moved on
    with trainer.use_params(kept):
        assert torch.equal(trainer.logprobs(batch), before)
