"""Quantized checkpoints: never cut by the shard rules (megarl/rollout/engine_shards.py), refused before a run
starts (megarl/preflight.py), and an engine quantized anyway refuses megarl's weight updates
(megarl/rollout/vllm_worker_ext.py), whose post-load re-run is for vLLM's unquantized methods alone.

vLLM reads a checkpoint's ``quantization_config`` (or compressed-tensors' ``compression_config``) and runs a
quantized engine: block-FP8 pads each expert's shard (768 / 4 = 192 rows, padded to whole 128-row blocks), and
NVFP4's post-load processing scales the loaded weights, so running it again would scale them twice.
"""
from types import SimpleNamespace

import pytest
from test_engine_shards import QWEN3_30B

from megarl.config import MegaRLConfig
from megarl.errors import ConfigError, EngineError
from megarl.preflight import check_config
from megarl.rollout.engine_shards import quantization_of, vllm_tp_rule

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
NAMES = {"model.layers.7.self_attn.q_proj.weight": (4096, 2048), "model.layers.7.self_attn.o_proj.weight": (2048, 4096),
         "model.layers.7.mlp.experts.93.gate_proj.weight": (768, 2048), "model.embed_tokens.weight": (151936, 2048)}


@pytest.mark.parametrize("key,value,method", [("quantization_config", FP8, "fp8"),
                                              ("quantization_config", {"quant_method": "modelopt_fp4"}, "modelopt_fp4"),
                                              ("compression_config", {"quant_method": "compressed-tensors"},
                                               "compressed-tensors")])
def test_a_quantized_checkpoint_is_sent_whole(key, value, method):
    assert all(vllm_tp_rule(QWEN3_30B, 4)(n, s) is not None for n, s in NAMES.items())  # unquantized: cut
    hf = {**QWEN3_30B, key: value}
    assert quantization_of(hf) == method and quantization_of(QWEN3_30B) is None
    assert all(vllm_tp_rule(hf, 4)(n, s) is None for n, s in NAMES.items())


def test_a_quantized_checkpoint_is_refused_before_a_run_starts():
    cfg = MegaRLConfig()
    hf = {**QWEN3_30B, "architectures": ["Qwen3MoeForCausalLM"], "quantization_config": FP8}
    with pytest.raises(ConfigError, match=r"quantization_config \(quant_method 'fp8'\).*unquantized \(bf16\) "
                                          r"checkpoint for model.checkpoint"):
        check_config(cfg, hf)


def test_a_quantized_engine_refuses_updates_and_no_quantized_post_load_step_is_rerun():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import FusedMoEModularMethod
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE

    from megarl.rollout.vllm_worker_ext import MegarlWorkerExtension, rerun_after_reload

    def method(cls, **attrs):  # an instance without vLLM's engine around it: only the attributes read here
        m = object.__new__(cls)
        m.__dict__.update(attrs)
        return m

    kernel = SimpleNamespace(fused_experts=SimpleNamespace())
    layer = SimpleNamespace()
    assert rerun_after_reload(method(UnquantizedFusedMoEMethod, moe_kernel=kernel), layer) == "fused_experts"
    for quantized in (Fp8MoEMethod, ModelOptNvFp4FusedMoE):
        assert rerun_after_reload(method(quantized, moe_kernel=kernel), layer) is None
        wrapped = method(FusedMoEModularMethod, moe_kernel=kernel, old_quant_method=method(quantized))
        assert rerun_after_reload(wrapped, layer) is None
    wrapped = method(FusedMoEModularMethod, moe_kernel=kernel, old_quant_method=method(UnquantizedFusedMoEMethod))
    assert rerun_after_reload(wrapped, layer) == "fused_experts"
    assert rerun_after_reload(None, layer) is None

    worker = object.__new__(MegarlWorkerExtension)
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(quantization="modelopt_fp4"))
    with pytest.raises(EngineError, match="quant_method 'modelopt_fp4'.*would load wrong weights"):
        worker._megarl_reload(iter([]))
