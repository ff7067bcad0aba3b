"""MegatronTrainer (1 rank, CPU) against HF transformers: log-probs, weights round trip, training, errors.

One process-wide megatron init serves the module (trainers are rebuilt per
checkpoint; parallel_state is reused).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from megarl.errors import CheckpointError, ConfigError, InputError

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "dense_tied": ("tiny_qwen3.yaml", {}),
    "dense_untied": ("tiny_qwen3.yaml", {"tie_word_embeddings": False}),
    "moe_norm_untied": ("tiny_qwen3_moe.yaml", {}),
    "moe_nonorm_untied": ("tiny_qwen3_moe.yaml", {"norm_topk_prob": False}),
    "moe_nonorm_tied": ("tiny_qwen3_moe.yaml", {"norm_topk_prob": False, "tie_word_embeddings": True}),
}
PARITY_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, (base, changes) in VARIANTS.items():
        fields = yaml.safe_load((REPO / "configs/models" / base).read_text())
        fields.update(changes)
        model_yaml = root / f"{name}.yaml"
        model_yaml.write_text(yaml.safe_dump(fields))
        out[name] = str(write_tiny_checkpoint(model_yaml, root / name, seed=1))
    return out


def make_batch(seed: int = 0):
    from megarl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([24, 9, 17, 3, 24, 12])
    B, L = len(lens), int(lens.max())
    tokens = torch.randint(1, 16, (B, L), generator=g)  # 0 is HF's padding_idx: only as padding
    for b in range(B):
        tokens[b, lens[b]:] = 0
    mask = (torch.arange(L - 1)[None] < (lens[:, None] - 1)).float()
    z = torch.zeros(B, L - 1)
    return TrainBatch(tokens=tokens, seq_lens=lens, loss_mask=mask, logp_behav=z, versions=z.long(),
                      advantages=z, traj_ids=[str(i) for i in range(B)])


def hf_model(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)


def hf_logprobs(model, batch) -> torch.Tensor:
    """Teacher-forced log-probs row by row (no padding inside HF's forward)."""
    out = torch.zeros(batch.tokens.shape[0], batch.tokens.shape[1] - 1)
    for b, n in enumerate(batch.seq_lens.tolist()):
        ids = batch.tokens[b: b + 1, :n]
        logits = model(ids).logits.float()
        out[b, : n - 1] = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out


def nll(logp, mb, normalizer):
    loss = -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"]
    return loss, {"nll_mb": float(loss.detach())}


def trainer_for(ckpt, **kw):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    kw.setdefault("micro_batch_tokens", 48)
    return MegatronTrainer(ckpt, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_hf(ckpts, variant):
    batch = make_batch()
    trainer = trainer_for(ckpts[variant])
    got = trainer.logprobs(batch)
    with torch.no_grad():
        ref = hf_logprobs(hf_model(ckpts[variant]), batch)
    assert got.shape == (6, 23) and got.dtype == torch.float32
    diff = (got - ref).abs().max().item()
    print(f"\n[parity] {variant}: max |megatron - hf| = {diff:.3g}")
    assert diff <= PARITY_TOL
    assert got[3, 2:].abs().sum() == 0  # past the row's end


def test_norm_topk_prob_matters(ckpts):
    """The two MoE routings differ, so the parity test above can tell them apart."""
    batch = make_batch()
    a, b = ckpts["moe_norm_untied"], ckpts["moe_nonorm_untied"]
    with torch.no_grad():
        ref_b = hf_logprobs(hf_model(b), batch)
        # same weights as b, routed the other way
        m = hf_model(b)
        m.config.norm_topk_prob = True
        for layer in m.model.layers:
            layer.mlp.gate.norm_topk_prob = True
        diff = (hf_logprobs(m, batch) - ref_b).abs().max().item()
    assert diff > 1e-3 and a != b


@pytest.mark.parametrize("variant", ["dense_tied", "moe_norm_untied"])
def test_export_round_trip_is_bit_exact(ckpts, variant, tmp_path):
    from safetensors.torch import load_file

    trainer = trainer_for(ckpts[variant])
    original = load_file(Path(ckpts[variant]) / "model.safetensors")
    streamed = dict(trainer.export_hf_weights())
    assert set(streamed) == set(original)
    assert all(torch.equal(streamed[k], original[k]) for k in original)
    trainer.save_hf_checkpoint(str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert all(torch.equal(saved[k], original[k]) for k in original)
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == trainer.hf_config
    reloaded = trainer_for(str(tmp_path / "saved"))
    a, b = trainer.get_params(), reloaded.get_params()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint_loads_identically(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(ckpts["moe_nonorm_untied"])
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (out / "config.json").write_text((src / "config.json").read_text())
    a, b = trainer_for(str(src)).get_params(), trainer_for(str(out)).get_params()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_step_gradient_is_sum_of_microbatch_losses(ckpts):
    batch = make_batch()
    trainer = trainer_for(ckpts["dense_untied"], micro_batch_tokens=30, lr=1e-2)
    hf = hf_model(ckpts["dense_untied"])
    lp = hf_logprobs(hf, batch)
    loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    hf_norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in hf.parameters() if p.grad is not None))
    metrics = trainer.train_step(batch, nll)
    assert metrics["skipped"] == 0.0 and trainer.version == 1
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(hf_norm, rel=1e-4)
    assert metrics["lr"] == pytest.approx(1e-2)
    losses = [metrics["loss"]] + [trainer.train_step(batch, nll)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses


def test_non_finite_loss_skips_the_step(ckpts):
    trainer = trainer_for(ckpts["moe_norm_untied"])
    before = trainer.get_params()
    metrics = trainer.train_step(make_batch(), lambda logp, mb, n: (logp.sum() * float("nan"), {}))
    assert metrics["skipped"] == 1.0 and metrics["skipped_nonfinite_loss"] == 1.0 and trainer.version == 0
    assert trainer.last_skip_reason == "non-finite loss"
    # finite loss (0), NaN gradient: d/dx sqrt(x) at 0 is inf, times 0
    metrics = trainer.train_step(make_batch(), lambda logp, mb, n: (torch.sqrt(logp.sum() * 0.0), {}))
    assert metrics["skipped_nonfinite_grad_norm"] == 1.0 and metrics["loss"] == 0.0 and trainer.version == 0
    after = trainer.get_params()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.train_step(make_batch(), nll)["skipped"] == 0.0 and trainer.version == 1


def test_params_swap_and_restore(ckpts):
    trainer = trainer_for(ckpts["dense_tied"])
    batch = make_batch()
    base = trainer.logprobs(batch)
    params = trainer.get_params()
    noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}
    with trainer.use_params(noisy):
        assert (trainer.logprobs(batch) - base).abs().max() > 1e-3
    assert torch.equal(trainer.logprobs(batch), base)
    trainer.train_step(batch, nll)
    trainer.set_params(params)  # roll back, optimizer included
    assert torch.equal(trainer.logprobs(batch), base)
    with pytest.raises(InputError, match="missing"):
        trainer.set_params({})


def test_lr_warmup_and_decay(ckpts):
    trainer = trainer_for(ckpts["dense_tied"], lr=1e-3, lr_warmup_steps=2, lr_decay="cosine", total_steps=4,
                          min_lr=1e-4)
    lrs = [trainer.train_step(make_batch(), nll)["lr"] for _ in range(4)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[1] > lrs[2] > lrs[3] == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="total_steps"):
        trainer_for(ckpts["dense_tied"], lr_decay="linear")


# -- bad input ---------------------------------------------------------------------------
def test_parallel_sizes_are_validated():
    from megarl.models.hf_config import validate_parallel

    dense = yaml.safe_load((REPO / "configs/models/tiny_qwen3.yaml").read_text())
    moe = yaml.safe_load((REPO / "configs/models/tiny_qwen3_moe.yaml").read_text())
    cases = [(dense, dict(tp=4, pp=1, ep=1, world_size=4), "tp=4 does not divide num_attention_heads=2"),
             (moe, dict(tp=4, pp=1, ep=1, world_size=4), "tp=4 does not divide num_key_value_heads=2"),
             (moe, dict(tp=1, pp=1, ep=3, world_size=3), "ep=3 does not divide num_experts=4"),
             (dense, dict(tp=1, pp=3, ep=1, world_size=3), "pp=3 does not divide num_hidden_layers=2"),
             (dense, dict(tp=2, pp=1, ep=1, world_size=3), "world size 3 is not divisible by tp\\*pp"),
             (moe, dict(tp=1, pp=2, ep=2, world_size=2), "not divisible by ep\\*tp"),
             (dense, dict(tp=1, pp=1, ep=2, world_size=2), "needs an MoE model")]
    for hf, sizes, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            validate_parallel(hf, **sizes)
    validate_parallel(moe, tp=1, pp=1, ep=2, world_size=2)


def test_trainer_rejects_parallel_sizes_before_init(ckpts):
    with pytest.raises(ConfigError, match="world size 1 is not divisible by tp\\*pp = 2\\*1"):
        trainer_for(ckpts["dense_tied"], tp=2)


def test_sequence_parallel_norms_replace_every_torch_norm_of_the_local_spec(ckpts):
    """The local spec's WrappedTorchNorm refuses sequence parallelism; megarl swaps in a torch norm
    whose weights carry the sequence_parallel mark (their TP gradient sum is checked on 2 ranks in
    tests/distributed/test_parallel.py)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megarl.models.hf_config import transformer_config_from_hf
    from megarl.models.sp_norm import SequenceParallelTorchNorm, allow_sequence_parallel

    trainer_for(ckpts["moe_norm_untied"])  # initializes megatron's groups (one rank)
    hf = yaml.safe_load((REPO / "configs/models/tiny_qwen3_moe.yaml").read_text())
    config = transformer_config_from_hf(hf)
    spec = allow_sequence_parallel(get_gpt_decoder_block_spec(config, use_transformer_engine=False))

    def modules(obj):
        if isinstance(obj, type):
            yield obj
        elif isinstance(obj, list):
            for x in obj:
                yield from modules(x)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                yield from modules(getattr(obj, f.name))
    found = list(modules(spec))
    assert WrappedTorchNorm not in found
    # per layer: input, pre-MLP, q and k norms; plus the final norm
    assert found.count(SequenceParallelTorchNorm) == 4 * config.num_layers + 1
    config.sequence_parallel = True
    norm = SequenceParallelTorchNorm(config, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True


def test_hf_config_translation():
    from megarl.models.hf_config import rope_theta, transformer_config_from_hf

    moe = yaml.safe_load((REPO / "configs/models/tiny_qwen3_moe.yaml").read_text())
    assert rope_theta({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}) == 5e5
    assert rope_theta({"rope_theta": 1e4}) == 1e4
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        rope_theta({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}})
    cfg = transformer_config_from_hf(moe)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_pre_softmax) == (4, 2, False)
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.qk_layernorm, cfg.moe_grouped_gemm) == (2, 32, True, False)
    assert transformer_config_from_hf(dict(moe, norm_topk_prob=False)).moe_router_pre_softmax is True
    with pytest.raises(ConfigError, match="mixed dense/MoE"):
        transformer_config_from_hf(dict(moe, mlp_only_layers=[0]))


def test_checkpoint_errors_name_the_file(ckpts, tmp_path):
    from megarl.models.bridge import HFWeights, read_hf_config

    with pytest.raises(CheckpointError, match=r"config\.json: file is missing"):
        read_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFWeights(tmp_path)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(Path(ckpts["dense_tied"], "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(CheckpointError, match=r"corrupt/model\.safetensors: cannot read"):
        trainer_for(str(corrupt))
    missing_shard = tmp_path / "missing_shard"
    missing_shard.mkdir()
    (missing_shard / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: file is missing"):
        HFWeights(missing_shard).get("model.embed_tokens.weight")
    with pytest.raises(CheckpointError, match="'model.norm.weight' is not in the checkpoint"):
        HFWeights(missing_shard).get("model.norm.weight")


def test_too_long_input_is_rejected(ckpts):
    from megarl.types import TrainBatch

    trainer = trainer_for(ckpts["dense_tied"])
    tokens = torch.ones(1, 129, dtype=torch.long)
    z = torch.zeros(1, 128)
    batch = TrainBatch(tokens=tokens, seq_lens=torch.tensor([129]), loss_mask=z, logp_behav=z,
                       versions=z.long(), advantages=z, traj_ids=["x"])
    with pytest.raises(InputError, match="129 tokens > max_position_embeddings 128"):
        trainer.logprobs(batch)
    with pytest.raises(InputError, match=r"token ids must be in \[0, 18\)"):
        trainer.logprobs(TrainBatch(tokens=torch.tensor([[1, 99]]), seq_lens=torch.tensor([2]),
                                    loss_mask=z[:, :1], logp_behav=z[:, :1], versions=z[:, :1].long(),
                                    advantages=z[:, :1], traj_ids=["y"]))


def test_a_non_finite_log_prob_from_the_forward_skips_the_step_like_a_non_finite_loss(ckpts):
    from megarl.losses import PolicyLossConfig
    from megarl.losses.policy import policy_loss

    trainer = trainer_for(ckpts["dense_untied"])
    before = trainer.get_params()

    def overflowing(logp, mb, normalizer):  # the forward's log-prob of one valid token overflowed to -inf
        bad = torch.zeros_like(logp)
        bad[0, 0] = -math.inf
        mask = mb.loss_mask.to(logp.device)
        adv = torch.ones_like(logp)
        return policy_loss(logp + bad, logp.detach(), logp.detach(), adv, mask, PolicyLossConfig())

    metrics = trainer.train_step(make_batch(), overflowing)
    assert metrics["skipped"] == 1.0 and metrics["skipped_nonfinite_loss"] == 1.0 and trainer.version == 0
    assert trainer.last_skip_reason == "non-finite loss"
    assert metrics["n_nonfinite_logp_theta"] >= 1.0
    after = trainer.get_params()
    assert all(torch.equal(before[k], after[k]) for k in before)
