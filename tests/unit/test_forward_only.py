"""Forward-only scorers: the dedicated scorer's model holds no gradient buffer and no optimizer (CPU, gloo).

Megatron's DDP allocates an fp32 gradient buffer of every parameter at
construction; a process that only scores old versions must not pay it (for a
30B model: 122 GB). The forward-only trainer must still score exactly as the
full trainer does.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from megarl.models.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml",
                                     tmp_path_factory.mktemp("fwd") / "moe", seed=5))


def gradient_state(trainer) -> dict[str, int]:
    """What a scorer must not have: DDP gradient buffers (bytes), main_grad tensors, trainable parameters."""
    from megatron.core.distributed import DistributedDataParallel

    # DDP's ``buffers`` are its _ParamAndGradBuffer list (a plain module's ``buffers`` is nn.Module's method)
    buffers = [b for chunk in trainer.model if isinstance(chunk, DistributedDataParallel) for b in chunk.buffers]
    params = list(trainer._module().parameters())
    return {"grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
            "main_grads": sum(hasattr(p, "main_grad") for p in params),
            "trainable": sum(p.requires_grad for p in params)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dedicated_scorer_allocates_no_gradient_buffer(ckpt, dtype):
    from test_parity_hf import make_batch

    from megarl.errors import ConfigError
    from megarl.trainer.megatron_trainer import MegatronTrainer
    from recovery._dedicated_scorer import _build_scorer

    full = MegatronTrainer(ckpt, dtype=dtype)  # the scorer's micro-batch layout: same GEMM shapes, same rounding
    n_params = sum(p.numel() for p in full._module().parameters())
    # the full trainer's fp32 buffer: 4 bytes per parameter (measured against the count, not assumed)
    assert gradient_state(full)["grad_buffer_bytes"] == 4 * n_params
    scorer = _build_scorer("", ckpt, dtype)
    assert gradient_state(scorer) == {"grad_buffer_bytes": 0, "main_grads": 0, "trainable": 0}
    assert scorer.optimizer is None
    batch = make_batch(1)
    torch.testing.assert_close(scorer.logprobs(batch), full.logprobs(batch), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="forward_only"):
        scorer.train_step(batch, lambda logp, mb, norm: (logp.sum(), {}))
