"""``rollout.batch_invariant``: engines and trainer on batch-invariant kernels ("true on-policy").

A token's log-prob from a GPU engine depends on what else was in its batch
(split-K GEMMs, attention splits and reductions change with the batch
shape), so the engine's ``logp_behav`` and the trainer's ``logp_old`` of the
same weights differ by bf16 noise. With ``rollout.batch_invariant: true``
both sides use kernels whose result does not depend on the batch:

- the trainer: megatron-core's ``batch_invariant_mode`` (its Triton kernels
  for ``mm``/``addmm``/``log_softmax``/``mean``, TransformerEngine's GEMM and
  RMSNorm patched, FlashAttention with one split), which needs CUDA, Triton
  and ``attention_backend=flash``;
- the engines: vLLM's batch-invariant kernels, ``VLLM_BATCH_INVARIANT=1`` in
  each engine's environment (spawned engines and launched engine roles).

It costs speed on both sides. Bitwise equality of behav's anchor and
logp_old also needs the same dtype on both sides (``rollout.dtype`` empty)
and is only verified where a GPU is at hand. Both sides are CUDA-only: on CPU
the setting is refused before the run starts.
"""
from __future__ import annotations

from megarl.errors import ConfigError

ENGINE_ENV = "VLLM_BATCH_INVARIANT"


def check(cfg, cuda: bool | None = None) -> None:
    """Refuse ``rollout.batch_invariant: true`` where it cannot run, naming the fix."""
    if not cfg.rollout.batch_invariant:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ConfigError("rollout.batch_invariant=true needs CUDA GPUs: megatron-core's batch-invariant kernels "
                          "are Triton GPU kernels and vLLM's VLLM_BATCH_INVARIANT kernels run on GPU only; "
                          "set rollout.batch_invariant=false on CPU")
    if cfg.rollout.backend != "vllm":
        raise ConfigError(f"rollout.batch_invariant=true needs rollout.backend=vllm (VLLM_BATCH_INVARIANT); "
                          f"rollout.backend={cfg.rollout.backend} has no batch-invariant kernels")
    if cfg.rollout.dtype and cfg.rollout.dtype != cfg.model.dtype:
        raise ConfigError(f"rollout.batch_invariant=true with rollout.dtype={cfg.rollout.dtype} beside "
                          f"model.dtype={cfg.model.dtype}: log-probs of two precisions never agree bitwise; "
                          f"leave rollout.dtype empty")


def engine_env(cfg) -> dict[str, str]:
    """Variables an engine process of this run needs (none unless ``rollout.batch_invariant``)."""
    return {ENGINE_ENV: "1"} if cfg.rollout.batch_invariant else {}


def enable_in_trainer(config) -> None:
    """Switch a trainer's TransformerConfig, before its model is built, and this process's kernels to the
    batch-invariant ones (megatron-core patches aten's mm/addmm/log_softmax/mean process-wide)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("rollout.batch_invariant=true: the trainer has no CUDA device (megatron-core's "
                          "batch-invariant kernels are Triton GPU kernels); set rollout.batch_invariant=false")
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import enable_batch_invariant_mode
    from megatron.core.transformer.enums import AttnBackend

    config.batch_invariant_mode = True
    config.attention_backend = AttnBackend.flash  # megatron-core's batch-invariant mode supports only this
    enable_batch_invariant_mode()
