"""``rollout.batch_invariant``: the trainer's forward and every engine on batch-invariant kernels.

A token's log-prob on a GPU depends on what else was in its batch (split-K
GEMMs, attention splits and reductions change with the batch shape). With
``rollout.batch_invariant: true`` each side computes a row's log-probs
independently of its batch:

- the trainer: megatron-core's ``batch_invariant_mode`` (megatron-core 0.16.1:
  its Triton kernels for aten's ``mm``/``addmm``/``log_softmax``/``mean``,
  TransformerEngine's ``general_gemm`` and RMSNorm patched, attention forced to
  FlashAttention with one split), which needs CUDA, Triton and the
  ``flash_attn`` package (checked on the trainer's host before the run);
- the engines: vLLM's batch-invariant kernels, ``VLLM_BATCH_INVARIANT=1`` in
  each engine's environment (spawned engines and launched engine roles).

What it gives: the trainer's log-probs of a row do not change with the batch
it is scored in, and neither do an engine's. What it does not give: engine =
trainer. vLLM and Megatron run different kernels (fused layers, attention
implementations, reduction orders), so ``logp_behav`` and ``logp_old`` still
differ by the kernels' rounding; r_d stays measured (``r_d/*``), never
assumed 1. Not covered, hence refused: MoE models, whose experts run
TransformerEngine's grouped GEMM, which megatron-core 0.16.1 does not patch.
Both sides are CUDA-only: a config placed on CPU is refused. Not yet run on
a GPU by megarl's checks.
"""
from __future__ import annotations

from megarl.errors import ConfigError

ENGINE_ENV = "VLLM_BATCH_INVARIANT"


def check(cfg, cuda: bool | None = None, hf: dict | None = None) -> None:
    """Refuse ``rollout.batch_invariant: true`` where it cannot run or would not hold, naming the fix (the
    settings alone: `megarl plan` and `megarl launch` check it too). ``cuda``: default, the config's placement."""
    if not cfg.rollout.batch_invariant:
        return
    if cuda is None:
        cuda = cfg.placement.device == "gpu"
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
    if hf is not None and int(hf.get("num_experts") or hf.get("num_local_experts") or 0):
        raise ConfigError("rollout.batch_invariant=true with an MoE model: its experts run TransformerEngine's "
                          "grouped GEMM, which megatron-core 0.16.1's batch-invariant mode does not patch, so the "
                          "trainer would not be batch invariant; set rollout.batch_invariant=false")


def check_host(cfg) -> None:
    """On the trainer's host, before the run: what the trainer's batch-invariant mode needs here."""
    import importlib.util

    if not cfg.rollout.batch_invariant:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("rollout.batch_invariant=true: this trainer host has no CUDA device (megatron-core's "
                          "batch-invariant kernels are Triton GPU kernels); set rollout.batch_invariant=false")
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("rollout.batch_invariant=true needs the flash_attn package (megatron-core's batch-"
                          "invariant mode forces FlashAttention): pip install flash-attn --no-build-isolation, "
                          "or set rollout.batch_invariant=false")


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
