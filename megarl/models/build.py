"""Build the megatron-core GPTModel of this rank's pipeline stage.

Layer spec: TransformerEngine's when both CUDA and TE are present (TE is
imported only inside that branch), megatron's local (pure torch) spec on CPU.
On CUDA without a working TE it is an error unless ``model.allow_local_spec``
asks for the local spec: its attention keeps full score matrices, tens of GB
more at long rows. Requires megatron parallel_state to be initialized
(megarl.trainer.parallel.init_parallel), which also runs prepare_megatron():
megatron is imported inside the functions, after that.
"""
from __future__ import annotations

import torch

from megarl.errors import ConfigError
from megarl.models import entropy
from megarl.models.hf_config import gpt_model_kwargs_from_hf
from megarl.models.sp_norm import allow_sequence_parallel
from megarl.platform.megatron import have_transformer_engine


def use_transformer_engine() -> bool:
    """TE spec only on CUDA machines with a working TransformerEngine."""
    return torch.cuda.is_available() and have_transformer_engine()


def grouped_gemm() -> bool:
    """MoE experts as one grouped GEMM per layer (TEGroupedMLP, ``moe_grouped_gemm``) where the TE spec is used;
    megatron's local spec would need its legacy GroupedMLP and the grouped_gemm package, so not there."""
    return use_transformer_engine()


TE_FIX = ("install it into the environment that runs the trainer: pip install --no-build-isolation "
          "'transformer_engine[pytorch]' (it builds against the installed torch; README, GPU setup)")


def layer_spec(config, *, vp_stage: int | None = None, allow_local_spec: bool = False):
    """Decoder block spec for this pipeline stage (only its layers), local or TE (module doc)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # megatron: module doc

    if torch.cuda.is_available() and not have_transformer_engine() and not allow_local_spec:
        raise ConfigError(f"CUDA is available but TransformerEngine is missing or does not import: {TE_FIX}; or set "
                          f"model.allow_local_spec=true to train with megatron's local layers (their attention "
                          f"keeps full score matrices: far more memory at long rows, see `megarl plan`)")
    if use_transformer_engine():
        import transformer_engine  # noqa: F401  (GPU-only; fails loudly here, not inside megatron)

        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    if config.sequence_parallel:
        spec = allow_sequence_parallel(spec)
    return spec


def build_gpt_model(hf: dict, config, temperature: float = 1.0, *, allow_local_spec: bool = False):
    """GPTModel for this rank: embedding on the first PP stage, final norm + output layer on the last.

    Parameters are allocated on the current device (CPU without CUDA) with
    megatron's random init; load real weights with megarl.models.bridge.
    With ``temperature`` != 1 the per-token cross entropy the model returns for
    ``labels`` is that of softmax(logits / temperature) (megarl/models/entropy.py ``install``, which
    also returns the per-token entropy on request).
    """
    from megatron.core import parallel_state, tensor_parallel  # megatron: module doc
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, allow_local_spec=allow_local_spec),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # keep logits vocab-parallel under TP: the loss/log-prob is computed by
        # vocab_parallel_cross_entropy, which never materializes full logits
        parallel_output=True,
        **gpt_model_kwargs_from_hf(hf),
    )
    # megatron's optimizer expects every parameter to carry TP attributes
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    entropy.install(model, temperature)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
