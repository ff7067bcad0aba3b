"""HF ``config.json`` (Qwen3, Qwen3-MoE) -> megatron ``TransformerConfig``: the one translation.

Everything megarl knows about mapping an HF config onto megatron-core lives
here: :func:`transformer_config_from_hf` for the transformer,
:func:`gpt_model_kwargs_from_hf` for the GPTModel arguments the config does
not carry (vocab, RoPE base, tied embeddings) and :func:`validate_parallel`
for the parallel sizes a model admits.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from megarl.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
#: trainer.recompute values (megarl/config/schema.py TrainerConfig.recompute)
RECOMPUTE = ("none", "selective", "full")


def num_experts(hf: dict) -> int:
    """Routed experts of an MoE config (0 for dense). transformers 5 writes ``num_local_experts``."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def is_moe(hf: dict) -> bool:
    return hf.get("model_type") == "qwen3_moe" and num_experts(hf) > 0


def rope_theta(hf: dict) -> float:
    """RoPE base. transformers 5 moved ``rope_theta`` into ``rope_parameters``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json has no rope_theta (neither top-level nor in rope_parameters)")
    return float(theta)


def _check_supported(hf: dict) -> None:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (Qwen3 uses silu)")
    if hf.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported")
    if model_type == "qwen3_moe":
        if num_experts(hf) <= 0:
            raise ConfigError("qwen3_moe config has no experts (num_experts / num_local_experts)")
        # Every layer must be sparse: the name mapping has no dense-MLP layers inside an MoE model.
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError(f"mixed dense/MoE layers are not supported (mlp_only_layers="
                              f"{hf.get('mlp_only_layers')}, decoder_sparse_step={hf.get('decoder_sparse_step')})")


def validate_parallel(hf: dict, tp: int, pp: int, ep: int, world_size: int) -> None:
    """Raise ConfigError (with the numbers) unless ``tp/pp/ep`` fit the model and the world size."""
    for name, size in (("tp", tp), ("pp", pp), ("ep", ep), ("world size", world_size)):
        if int(size) < 1:
            raise ConfigError(f"{name} must be >= 1, got {size}")
    heads, kv_heads = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    layers, vocab = int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    if heads % tp:
        raise ConfigError(f"tp={tp} does not divide num_attention_heads={heads}")
    if kv_heads % tp:
        raise ConfigError(f"tp={tp} does not divide num_key_value_heads={kv_heads}")
    if vocab % tp:
        raise ConfigError(f"tp={tp} does not divide vocab_size={vocab} (vocab padding is not supported)")
    if layers % pp:
        raise ConfigError(f"pp={pp} does not divide num_hidden_layers={layers}")
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
    if is_moe(hf):
        n_exp = num_experts(hf)
        if n_exp % ep:
            raise ConfigError(f"ep={ep} does not divide num_experts={n_exp}")
        # expert layers split each pipeline stage's ranks into ep x expert-tp(=tp) x expert-dp
        if (world_size // pp) % (ep * tp):
            raise ConfigError(f"world size {world_size} / pp {pp} = {world_size // pp} ranks per stage is not "
                              f"divisible by ep*tp = {ep}*{tp} = {ep * tp}")
        if int(hf["moe_intermediate_size"]) % tp:
            raise ConfigError(f"tp={tp} does not divide moe_intermediate_size={hf['moe_intermediate_size']}")
    else:
        if ep != 1:
            raise ConfigError(f"ep={ep} needs an MoE model; {hf.get('model_type')} is dense")
        if int(hf["intermediate_size"]) % tp:
            raise ConfigError(f"tp={tp} does not divide intermediate_size={hf['intermediate_size']}")


def transformer_config_from_hf(hf: dict, *, tp: int = 1, pp: int = 1, ep: int = 1,
                               dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                               recompute: str = "none", grouped_gemm: bool = False):
    """Translate a Qwen3 / Qwen3-MoE ``config.json`` dict into a megatron ``TransformerConfig``.

    Architecture: GQA (``num_query_groups``), per-head RMSNorm on q and k
    (``qk_layernorm``), RMSNorm, SwiGLU (gated silu, no biases). MoE routing
    matches HF exactly: HF takes softmax over all experts, keeps the top-k and,
    with ``norm_topk_prob``, renormalizes them. Megatron's softmax router with
    ``moe_router_pre_softmax=False`` takes top-k of the logits and softmaxes
    those k, which equals the renormalized probabilities; with
    ``moe_router_pre_softmax=True`` it softmaxes first and keeps the raw top-k
    probabilities, which is ``norm_topk_prob=False``. Experts are one
    ``SequentialMLP`` per layer, or with ``grouped_gemm`` (CUDA and
    TransformerEngine: megarl.models.build.grouped_gemm) one ``TEGroupedMLP``
    running all local experts as one grouped GEMM (``moe_grouped_gemm``; its
    ``linear_fcN.weight{e}`` are the names the bridge maps to HF). No
    load-balancing loss (RL fine-tuning).

    ``recompute`` (activation recomputation, :func:`recompute_fields`) changes
    what the backward keeps, never what it computes.
    """
    from megatron.core.transformer import TransformerConfig  # megatron: after prepare_megatron()

    _check_supported(hf)
    moe: dict[str, Any] = {}
    if is_moe(hf):
        if int(hf.get("num_experts_per_tok", 0)) < 1:
            raise ConfigError(f"num_experts_per_tok must be >= 1, got {hf.get('num_experts_per_tok')}")
        moe = dict(
            num_moe_experts=num_experts(hf),
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", False)),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=grouped_gemm,
            # each router gets a RouterReplay; it routes live until megarl/trainer/routing_replay.py sets routes
            moe_enable_routing_replay=True,
        )
    fields = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        num_query_groups=int(hf["num_key_value_heads"]),
        kv_channels=int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"])),
        ffn_hidden_size=int(hf["intermediate_size"]),
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=sequence_parallel and tp > 1,
        # micro-batches differ in length (packed by token budget)
        variable_seq_lengths=True,
        # megatron rejects the default (allgather) dispatcher with variable_seq_lengths, even for dense
        moe_token_dispatcher_type="alltoall",
        **moe,
        **recompute_fields(recompute),
    )
    with warnings.catch_warnings():
        # 0.16.1 warns about its own default cuda_graph_scope on every construction
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        # selective recompute of core_attn warns that TE's fused attention would not need it (true, not ours)
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        return TransformerConfig(**fields)


def recompute_fields(recompute: str) -> dict[str, Any]:
    """TransformerConfig fields of ``trainer.recompute``.

    full: every layer keeps only its input and reruns its forward in the
    backward (uniform method, one layer per unit). selective: megatron's
    default module list, the core attention only (the score matrices of the
    local spec; TransformerEngine's fused attention keeps none, so there it
    saves little). ``moe_act`` is refused by megatron without grouped GEMM and
    is not asked for.
    """
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def gpt_model_kwargs_from_hf(hf: dict) -> dict[str, Any]:
    """GPTModel arguments that are not TransformerConfig fields."""
    return dict(
        vocab_size=int(hf["vocab_size"]),
        max_sequence_length=int(hf["max_position_embeddings"]),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )
