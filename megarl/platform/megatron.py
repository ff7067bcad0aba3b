"""What megatron-core needs to run on the machine at hand.

On a CUDA machine nothing is patched. Without CUDA, :func:`apply_cpu_patches`
(megarl/platform/cpu.py) adapts megatron-core 0.16.1 to run on CPU with gloo.
Call :func:`prepare_megatron` before the first ``import megatron.core``.
"""
from __future__ import annotations

import torch

from megarl.platform.cpu import apply_cpu_patches, block_broken_transformer_engine


def have_transformer_engine() -> bool:
    """True when TransformerEngine imports cleanly.

    A CUDA build of TE on a machine without CUDA raises RuntimeError (cudnn
    shared object not found), not ImportError, so both are caught.
    """
    try:
        import transformer_engine  # noqa: F401  (GPU-only package: probed, never required)
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def define_missing_te_general_gemm() -> None:
    """megatron-core 0.16.1's MoE router reads the name ``te_general_gemm``, bound only when
    TransformerEngine imports; without TE (CPU, or a GPU without TE) that is a NameError at the
    first MoE forward. Bound to None it takes the plain ``torch.mm`` path. Seen on CPU and on an
    H200 with torch 2.11 and no TE."""
    from megatron.core.transformer.moe import moe_utils  # megatron: only after prepare_megatron's patches

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def prepare_megatron() -> None:
    """Make ``import megatron.core`` safe here; apply the CPU patches when CUDA is absent."""
    block_broken_transformer_engine()
    if not torch.cuda.is_available():
        apply_cpu_patches()
    define_missing_te_general_gemm()


__all__ = ["define_missing_te_general_gemm", "have_transformer_engine", "prepare_megatron"]
