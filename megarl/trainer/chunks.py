"""The trainer's model chunks: the GPTModel of this rank, wrapped for training or for forwards only.

Training wraps it in Megatron's DDP, which allocates a gradient buffer the
size of the parameters at construction (fp32: ``grad_reduce_in_fp32``), twice
the bf16 weights. A forward-only model (a scorer of old versions: the
dedicated scorer's process) keeps the bare module: no DDP, no gradient
buffer, parameters without ``requires_grad``, and never an optimizer.
"""
from __future__ import annotations

from megarl.models.build import build_gpt_model


def build_chunks(hf_config: dict, config, temperature: float, *, use_distributed_optimizer: bool,
                 forward_only: bool = False, allow_local_spec: bool = False) -> list:
    """``[model]`` of this rank: DDP(Float16Module(GPTModel)) for training (Float16Module only under bf16),
    Float16Module(GPTModel) or GPTModel with frozen parameters when ``forward_only``."""
    gpt = build_gpt_model(hf_config, config, temperature, allow_local_spec=allow_local_spec)
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        # as Megatron-LM's get_model: casts the parameters to bf16, the first stage's inputs to
        # bf16 and the last stage's outputs (per-token cross entropy) back to fp32
        gpt = Float16Module(config, gpt)
    if forward_only:
        for p in gpt.parameters():
            p.requires_grad_(False)
        return [gpt]
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    # fp32 gradient buffers (main_grad) in both precisions: bf16 gradients would lose the small updates
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)]

    def finalize_sum(chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        # DP all-reduce, TP sync of q/k-norm grads, tied-embedding sync; never divide by token counts
        finalize_model_grads(chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    # without it q/k layernorm grads are not synced and the weights diverge across TP ranks
    config.finalize_model_grads_func = finalize_sum
    return model
