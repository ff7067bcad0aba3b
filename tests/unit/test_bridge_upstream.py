"""Pin the mbridge 0.15.1 behaviour megarl.models.bridge relies on or works around.

A failure here means upstream changed: re-check the adaptations listed in
megarl/models/bridge.py before updating the expectations.
"""
from __future__ import annotations

import importlib.metadata
import types

import pytest
import torch

DENSE = dict(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=2, max_position_embeddings=32,
             rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=True,
             rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
MOE = dict(DENSE, model_type="qwen3_moe", num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
           norm_topk_prob=False, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
           router_aux_loss_coef=0.0)


@pytest.fixture(scope="module")
def megatron():
    from megarl.platform.megatron import prepare_megatron

    prepare_megatron()


def _bridge(hf, tp_size=1):
    from megarl.models.bridge import make_bridge
    from megarl.models.hf_config import transformer_config_from_hf

    return make_bridge(hf, transformer_config_from_hf(hf, tp=tp_size), tp_size=tp_size)


def test_mbridge_version():
    assert importlib.metadata.version("mbridge") == "0.15.1"


def test_local_spec_names_become_mbridge_names():
    from megarl.models.bridge import canonical_name

    assert canonical_name("decoder.layers.0.input_layernorm.weight", moe=False, layer_offset={0: 3}) == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_name("decoder.layers.1.pre_mlp_layernorm.weight", moe=False) == \
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert canonical_name("decoder.layers.1.pre_mlp_layernorm.weight", moe=True) == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", moe=True,
                          expert_offset=2) == "decoder.layers.0.mlp.experts.linear_fc2.weight3"
    # already-canonical (TransformerEngine spec, grouped experts) names pass through
    for name in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.0.mlp.experts.linear_fc1.weight2"):
        assert canonical_name(name, moe=True) == name
    # grouped experts (TEGroupedMLP, moe_grouped_gemm=True) are numbered per EP rank too: global = offset + local
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc1.weight2", moe=True, expert_offset=4) == \
        "decoder.layers.0.mlp.experts.linear_fc1.weight6"


def test_dense_layer_names(megatron):
    b = _bridge(DENSE)
    m = {n: b._weight_name_mapping_mcore_to_hf(f"decoder.layers.1.{n}") for n in (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
        "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight")}
    p = "model.layers.1."
    assert m == {
        "self_attention.linear_qkv.layer_norm_weight": [p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                             p + "self_attn.v_proj.weight"],
        "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        "mlp.linear_fc1.layer_norm_weight": [p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
    }
    assert b._weight_name_mapping_mcore_to_hf("embedding.word_embeddings.weight") == ["model.embed_tokens.weight"]
    assert b._weight_name_mapping_mcore_to_hf("decoder.final_layernorm.weight") == ["model.norm.weight"]
    # tied: the last PP stage's output_layer copy reads the embedding
    assert b._weight_name_mapping_mcore_to_hf("output_layer.weight") == ["model.embed_tokens.weight"]


def test_moe_layer_names(megatron):
    b = _bridge(MOE)
    p = "model.layers.0."
    assert b._weight_name_mapping_mcore_to_hf("decoder.layers.0.pre_mlp_layernorm.weight") == \
        [p + "post_attention_layernorm.weight"]
    assert b._weight_name_mapping_mcore_to_hf("decoder.layers.0.mlp.router.weight") == [p + "mlp.gate.weight"]
    assert b._weight_name_mapping_mcore_to_hf("decoder.layers.0.mlp.experts.linear_fc1.weight3") == \
        [p + "mlp.experts.3.gate_proj.weight", p + "mlp.experts.3.up_proj.weight"]
    assert b._weight_name_mapping_mcore_to_hf("decoder.layers.0.mlp.experts.linear_fc2.weight2") == \
        [p + "mlp.experts.2.down_proj.weight"]
    assert b._weight_name_mapping_mcore_to_hf("output_layer.weight") == ["lm_head.weight"]


def test_qkv_and_fc1_layouts(megatron):
    b = _bridge(DENSE)
    # 4 query heads in 2 KV groups, head_dim 2: rows labelled by (tensor, row)
    q = torch.arange(8).float().view(8, 1).expand(8, 8) + 100
    k = torch.arange(4).float().view(4, 1).expand(4, 8) + 200
    v = torch.arange(4).float().view(4, 1).expand(4, 8) + 300
    qkv = b._weight_to_mcore_format("decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v])
    # megatron layout: per KV group, its query heads, then its key head, then its value head
    assert qkv[:, 0].tolist() == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    names, back = b._weight_to_hf_format("decoder.layers.0.self_attention.linear_qkv.weight", qkv)
    assert all(torch.equal(x, y) for x, y in zip(back, [q, k, v]))
    gate, up = torch.zeros(12, 8), torch.ones(12, 8)
    fc1 = b._weight_to_mcore_format("decoder.layers.0.mlp.linear_fc1.weight", [gate, up])
    assert torch.equal(fc1, torch.cat([gate, up]))


def test_tp_split_rules(megatron):
    b = _bridge(DENSE, tp_size=2)
    fc1 = torch.arange(24).float().view(24, 1)  # gate rows 0..11, up rows 12..23
    param = torch.empty(12, 1)
    shards = b._weight_split_across_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, param, 2)
    assert shards[0][:, 0].tolist() == list(range(0, 6)) + list(range(12, 18))
    like = torch.empty(0)
    like.tensor_model_parallel, like.partition_dim = True, 0
    assert torch.equal(b._weight_merge_across_tp("decoder.layers.0.mlp.linear_fc1.weight", list(shards), like), fc1)
    qkv = torch.arange(16).float().view(16, 1)
    assert b._weight_split_across_tp("decoder.layers.0.self_attention.linear_qkv.weight", qkv,
                                     torch.empty(8, 1), 2)[1][:, 0].tolist() == list(range(8, 16))


def test_upstream_quirks_still_need_workarounds(megatron):
    """The three mbridge behaviours megarl works around (see megarl/models/bridge.py)."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen3 import Qwen3Bridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    saved = dict(Qwen3Bridge._DIRECT_MAPPING)
    try:
        Qwen3Bridge(types.SimpleNamespace(**DENSE), dtype=torch.float32, parallel_states=ParallelStates())
        # 1. a tied model rewrites the class-level mapping for every later model
        assert Qwen3Bridge._DIRECT_MAPPING["output_layer.weight"] == "model.embed_tokens.weight"
        untied = _bridge(dict(DENSE, tie_word_embeddings=False))
        assert untied._weight_name_mapping_mcore_to_hf("output_layer.weight") == ["lm_head.weight"]
    finally:
        Qwen3Bridge._DIRECT_MAPPING.clear()
        Qwen3Bridge._DIRECT_MAPPING.update(saved)
    # 2. transformers 5 writes num_local_experts; mbridge reads num_experts
    with pytest.raises(AttributeError, match="num_experts"):
        Qwen3MoEBridge(types.SimpleNamespace(**MOE), dtype=torch.float32, parallel_states=ParallelStates())
    # 3. its own config ignores norm_topk_prob=False (megarl's maps it to pre-softmax routing)
    native = Qwen3MoEBridge(types.SimpleNamespace(**MOE, num_experts=4), dtype=torch.float32,
                            parallel_states=ParallelStates())
    assert native.config.moe_router_pre_softmax is False
    assert _bridge(MOE).config.moe_router_pre_softmax is True
