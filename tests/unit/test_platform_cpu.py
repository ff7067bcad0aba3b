"""megarl.platform.cpu: the CPU adaptations of megatron-core, and that they leave HF transformers intact."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are never applied with CUDA")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu():
    from megarl.platform import cpu as cpu_mod
    from megarl.platform.megatron import prepare_megatron

    prepare_megatron()
    return cpu_mod


def test_apply_is_idempotent(cpu):
    names = ("zeros", "ones", "empty", "full", "tensor", "arange")
    before = [getattr(torch, n) for n in names] + [torch.Tensor.to, torch.Tensor.cuda, torch.cuda.current_device,
                                                   torch.cuda.Stream]
    assert cpu.apply_cpu_patches() is True
    assert cpu.apply_cpu_patches() is True
    after = [getattr(torch, n) for n in names] + [torch.Tensor.to, torch.Tensor.cuda, torch.cuda.current_device,
                                                  torch.cuda.Stream]
    assert all(a is b for a, b in zip(before, after))
    # wrapped exactly once: the wrapper's target is torch's own function
    assert torch.zeros.__wrapped__ is cpu.ORIGINALS["torch.zeros"]
    assert not hasattr(cpu.ORIGINALS["torch.zeros"], "__megarl_cpu_patch__")


def test_cuda_device_requests_land_on_cpu(cpu):
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.tensor([1.0], device="cuda:0", pin_memory=True).device.type == "cpu"
    assert torch.arange(3, device="cuda").tolist() == [0, 1, 2]
    assert torch.full_like(torch.zeros(2), 7.0, device="cuda").tolist() == [7.0, 7.0]
    t = torch.randn(3)
    assert t.cuda() is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(device="cuda", dtype=torch.float64).dtype == torch.float64
    assert t.to(torch.float16).dtype == torch.float16  # dtype-only calls untouched
    m = torch.nn.Linear(2, 2)
    assert m.cuda() is m and m.weight.device.type == "cpu"
    assert torch.cuda.is_available() is False  # other libraries keep choosing CPU paths


def test_device_context_mode_still_recognizes_factories(cpu):
    # HF from_pretrained builds under `with torch.device(...)`; torch matches the constructors it
    # cached before wrapping. If the cache held the wrappers, arange would ignore the context.
    with torch.device("meta"):
        assert torch.arange(4).device.type == "meta"
        assert torch.zeros(2).device.type == "meta"


def test_cuda_type_names_only_inside_patched_functions(cpu):
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    assert p.type() == "torch.FloatTensor"
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)  # asserts a cuda type
    assert torch.allclose(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))
    assert p.type() == "torch.FloatTensor"


def test_bf16_optimizer_accepts_cpu_bf16_params(cpu):
    """Mixed precision: the constructor sorts params by CUDA type name ('torch.cuda.BFloat16Tensor')."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    w = torch.nn.Parameter(torch.full((4,), 1.5, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([w, b]),
                                            OptimizerConfig(bf16=True, params_dtype=torch.bfloat16), None, None)
    assert opt.float16_groups == [[w]] and opt.fp32_from_fp32_groups == [[b]]
    (main,) = opt.fp32_from_float16_groups[0]
    assert main.dtype == torch.float32 and torch.equal(main, w.float()) and w.main_param is main
    assert w.type() == "torch.BFloat16Tensor"


def test_moe_adaptations(cpu):
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert moe_utils.te_general_gemm is None
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [1, 2]
    s = torch.cuda.Stream()
    assert torch.cuda.current_stream() == s  # one synchronous CPU "stream"
    with torch.cuda.stream(s):
        s.record_event().synchronize()


def test_cpu_device_mapping(cpu):
    assert cpu._cpu_device("cuda:1") == "cpu"
    assert cpu._cpu_device(torch.device("cuda")) == torch.device("cpu")
    assert cpu._cpu_device(0) == "cpu"
    assert cpu._cpu_device("meta") == "meta"
    assert cpu._cpu_device(torch.device("meta")) == torch.device("meta")


def test_hf_logits_unchanged_and_broken_te_tolerated(tmp_path):
    """Fresh process: HF logits before patching == after patching, with a TE that raises RuntimeError."""
    fake = tmp_path / "site" / "transformer_engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("cudnn shared object not found (fake)")\n')
    script = textwrap.dedent(f"""
        import json, torch, transformers
        from megarl.models.tiny import write_tiny_checkpoint
        ckpt = write_tiny_checkpoint({str(REPO / 'configs/models/tiny_qwen3.yaml')!r}, {str(tmp_path / 'ckpt')!r})
        tokens = torch.tensor([[1, 4, 5, 6, 7, 8, 9, 2, 10, 11, 3]])
        def logits():
            m = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
            with torch.no_grad():
                return m(tokens).logits
        before = logits()
        from megarl.platform.megatron import prepare_megatron, have_transformer_engine
        prepare_megatron()
        import megatron.core  # crashes without the TE guard
        from megarl.platform.cpu import cpu_patches_applied
        after = logits()
        print(json.dumps({{"diff": (before - after).abs().max().item(), "te": have_transformer_engine(),
                           "patched": cpu_patches_applied()}}))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["patched"] and not result["te"]
    assert result["diff"] <= 1e-6, result
