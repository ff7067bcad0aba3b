"""Shard-aware weight sync: each vLLM tensor-parallel worker receives only the part of a tensor it loads.

An engine with vLLM tensor parallelism k has k workers, and each worker's
``load_weights`` keeps one slice of most tensors (vLLM's column-parallel
layers split the output dimension, row-parallel ones the input dimension,
the vocabulary embedding a padded range of rows). Sending every worker the
full tensors moves k times the model per engine; this module cuts the
export into k streams, stream t holding worker t's slices, so a publish
moves the model about once per engine (the replicated tensors: norms, MoE
router gates and KV heads shared by several ranks, once per worker).

The slices follow vLLM's own loaders for the Qwen3 / Qwen3-MoE families, by
HF tensor name:

==========================================  ====  ===================================================
``*.q_proj.{weight,bias}``                   0     rank t's heads: ``t * H*d/k`` (QKVParallelLinear)
``*.k_proj.*``, ``*.v_proj.*``               0     KV heads of rank ``t // max(1, k/KV)``; KV heads
                                                   are replicated when k > KV
``*.o_proj.weight``                          1     RowParallelLinear
``*.gate_proj.weight``, ``*.up_proj.weight`` 0     MergedColumnParallelLinear and the fused experts'
                                                   w1/w3 (``shape // k`` rows per rank)
``*.down_proj.weight``                       1     RowParallelLinear and the experts' w2
``*embed_tokens.weight``, ``lm_head.weight`` 0     VocabParallelEmbedding: the vocabulary padded to a
                                                   multiple of 64, ``padded/k`` rows per rank, the
                                                   rows past the real vocabulary dropped (a rank may
                                                   get none)
anything else (norms, ``mlp.gate``)          -     the full tensor to every worker
==========================================  ====  ===================================================

A dimension that k does not divide is sent whole (the worker's loader cuts it as before), and so is
every tensor of an architecture outside :data:`CUT_ARCHITECTURES` (those whose loaders these rules
were checked against), and every tensor of a quantized checkpoint (a ``quantization_config`` in its
HF config: vLLM's quantized layers do not split evenly, block-FP8 pads each expert's shard to whole
blocks). megarl does not publish to quantized engines at all (:func:`refuse_quantized`): they take
quantized tensors and scales, megarl's trainer exports unquantized weights.

The receiver widens each slice back into a zero tensor of the full shape
(megarl/rollout/bucket_format.py :func:`~megarl.rollout.bucket_format.unpack`)
and hands that to vLLM's unchanged loader, which reads exactly the slice
it was sent: correctness rests on vLLM's loaders, and a slice rule that
disagreed with them would load zeros, which tests/e2e/test_vllm_engine.py
shows as log-probs far from the HF model's (its negative control swaps the
two workers' slices). Only the bytes on the wire shrink; a worker holds one full
tensor at a time while it loads (the loader may keep one layer's).

Engine expert parallelism (vLLM's ``enable_expert_parallel``) is not used by
megarl's engines; with it the expert tensors would be cut by expert instead.
"""
from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from megarl.errors import ConfigError

if TYPE_CHECKING:  # the rules are plain arithmetic: `megarl plan` prices a publish with them
    import torch

#: vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py)
VOCAB_PADDING = 64

#: architectures whose vLLM loaders the rules were checked against (tests/e2e/test_vllm_engine.py); others go whole
CUT_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})

#: ``(dim, start, length)`` of one worker's slice of one tensor
Slice = tuple[int, int, int]
#: ``rule(name, shape)``: one slice per worker, or None (every worker gets the full tensor)
ShardRule = Callable[[str, tuple[int, ...]], "list[Slice] | None"]

_SUFFIX = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|embed_tokens|lm_head)"
                     r"\.(weight|bias)$")


def quantization_of(hf: dict) -> str | None:
    """The quantization method a checkpoint's HF config names, as vLLM reads it (``quantization_config``, or
    compressed-tensors' ``compression_config``; its ``quant_method``), or None for an unquantized one."""
    for key in ("quantization_config", "compression_config"):
        q = hf.get(key)
        if q:
            return str(q.get("quant_method") or "unknown") if isinstance(q, dict) else str(q)
    return None


def quantized_update_error(method: str) -> str:
    """Why megarl refuses to update the weights of an engine quantized with ``method``, and the fix."""
    return (f"the checkpoint's HF config has a quantization_config (quant_method {method!r}): vLLM runs it as a "
            f"quantized engine, which loads quantized tensors with their scales, while megarl publishes the "
            f"trainer's unquantized weights; an update would load wrong weights (block-FP8 pads each expert "
            f"shard, NVFP4's post-load processing would scale them again). Use the model's unquantized (bf16) "
            f"checkpoint for model.checkpoint")


def refuse_quantized(hf: dict) -> None:
    """ConfigError (:func:`quantized_update_error`) when ``hf`` is a quantized checkpoint's config."""
    method = quantization_of(hf)
    if method is not None:
        raise ConfigError(quantized_update_error(method))


def vllm_tp_rule(hf: dict, k: int) -> ShardRule:
    """The slices vLLM's Qwen3 / Qwen3-MoE loaders keep on each of ``k`` tensor-parallel workers (module doc);
    another architecture's tensors, and a quantized checkpoint's, all go whole (a config without
    ``architectures`` is taken for Qwen3)."""
    if quantization_of(hf) is not None or not set(hf.get("architectures") or ["Qwen3ForCausalLM"]) <= CUT_ARCHITECTURES:
        return lambda name, shape: None
    heads, kv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    vocab = int(hf["vocab_size"])

    def even(dim: int, size: int) -> list[Slice] | None:
        if size % k:
            return None
        part = size // k
        return [(dim, t * part, part) for t in range(k)]

    def rule(name: str, shape: tuple[int, ...]) -> list[Slice] | None:
        m = _SUFFIX.search(name)
        if k <= 1 or m is None or not shape:
            return None
        kind, param = m.groups()
        if kind in ("k_proj", "v_proj"):
            if shape[0] != kv * head_dim:
                return None
            per_rank, replicas = max(1, kv // k), max(1, k // kv)
            if kv % k and k % kv:
                return None
            part = per_rank * head_dim
            return [(0, (t // replicas) * part, part) for t in range(k)]
        if kind in ("embed_tokens", "lm_head"):
            if shape[0] != vocab:
                return None
            padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
            if padded % k:
                return None
            per = padded // k
            starts = [min(t * per, vocab) for t in range(k + 1)]
            return [(0, starts[t], starts[t + 1] - starts[t]) for t in range(k)]
        if kind in ("o_proj", "down_proj"):
            return even(1, shape[1]) if param == "weight" and len(shape) == 2 else None
        return even(0, shape[0])  # q_proj, gate_proj, up_proj

    return rule


def cut(t: torch.Tensor, s: Slice | None) -> torch.Tensor:
    """Worker's part of ``t`` (a view; None: all of it)."""
    return t if s is None else t.narrow(s[0], s[1], s[2])


def shard_rows(bucket: list[tuple[str, torch.Tensor]], rule: ShardRule, t: int) -> list[tuple[str, torch.Tensor]]:
    """Worker ``t``'s part of each tensor of one bucket; a sliced tensor carries its full shape and slice
    (``tensor.megarl_slice``, read by :func:`~megarl.rollout.bucket_format.pack`)."""
    out = []
    for name, x in bucket:
        slices = rule(name, tuple(x.shape))
        if slices is None:
            out.append((name, x))
            continue
        part = cut(x, slices[t]).contiguous()
        part.megarl_slice = (list(x.shape), slices[t][0], slices[t][1])
        out.append((name, part))
    return out


def hf_tensor_shapes(hf: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The HF tensors of a Qwen3 / Qwen3-MoE config, by name and shape (what the trainer exports)."""
    h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    heads, kv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    hd = int(hf.get("head_dim") or h // heads)
    n_exp = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield from ((p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                    (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                    (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)))
        if n_exp:
            mi = int(hf["moe_intermediate_size"])
            yield p + "mlp.gate.weight", (n_exp, h)
            for e in range(n_exp):
                q = f"{p}mlp.experts.{e}."
                yield from ((q + "gate_proj.weight", (mi, h)), (q + "up_proj.weight", (mi, h)),
                            (q + "down_proj.weight", (h, mi)))
        else:
            inter = int(hf["intermediate_size"])
            yield from ((p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                        (p + "mlp.down_proj.weight", (h, inter)))
    yield "model.norm.weight", (h,)
    if not hf.get("tie_word_embeddings"):
        yield "lm_head.weight", (vocab, h)


def sent_elements(shapes: Iterable[tuple[str, tuple[int, ...]]], rule: ShardRule, k: int) -> int:
    """Elements one engine of ``k`` workers receives for ``shapes`` under ``rule`` (k x a tensor sent whole)."""
    total = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        slices = rule(name, shape) if k > 1 else None
        total += k * numel if slices is None else sum(numel // shape[d] * n for d, _, n in slices)
    return total
