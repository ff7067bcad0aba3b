"""A torch RMSNorm/LayerNorm for megatron's local layer spec that allows sequence parallelism.

megatron-core 0.16.1's ``WrappedTorchNorm`` (the local spec's norm without
Apex) asserts ``not config.sequence_parallel``. The assertion guards one thing:
under sequence parallelism each tensor-parallel rank normalizes a different
slice of the sequence, so the norm's weight gradients differ across TP ranks
and must be summed. Megatron's ``finalize_model_grads`` already sums the
gradients of every parameter marked ``sequence_parallel=True`` over the TP
group (the TE and Apex norms set that mark); this norm sets it too. The q/k
norms of attention run on whole sequences of each rank's own heads; their
gradients also differ across TP ranks and are summed the same way (megatron
sums q/k-layernorm gradients under ``qk_layernorm`` whether marked or not).

MoE layers with TP > 1 need sequence parallelism in megatron, so this is what
makes Qwen3-MoE trainable with ``parallel.tp > 1`` on the local spec (CPU, or
GPUs without TransformerEngine). tests/distributed checks TP2 against HF and
one rank.
"""
from __future__ import annotations

import dataclasses

import torch


class SequenceParallelTorchNorm:
    """Same constructor as megatron's ``WrappedTorchNorm``; returns a torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma:
            raise ValueError(f"SequenceParallelTorchNorm supports LayerNorm/RMSNorm without zero-centered gamma, "
                             f"not {config.normalization} (zero_centered_gamma={config.layernorm_zero_centered_gamma})")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def allow_sequence_parallel(spec):
    """The layer spec with every ``WrappedTorchNorm`` replaced by :class:`SequenceParallelTorchNorm`.

    Walks ModuleSpecs, submodule dataclasses and lists; returns new objects where something changed.
    """
    # megatron: imported after prepare_megatron(), by the trainer building its model
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def walk(obj):
        if obj is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(obj, ModuleSpec):
            return dataclasses.replace(obj, module=walk(obj.module), submodules=walk(obj.submodules))
        if isinstance(obj, list):
            return [walk(x) for x in obj]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            changes = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return dataclasses.replace(obj, **changes)
        return obj

    return walk(spec)
