"""MoE experts as one grouped GEMM (TEGroupedMLP) on CUDA with TransformerEngine, and the bridge's names for them.

Grouped experts need TE on CUDA, so only the decision, the config and the name
mapping are checked here: a grouped parameter ``mlp.experts.linear_fcN.weight{i}``
of EP rank e holds global expert e * n_local + i, read from and exported to that
expert's HF tensors, as megatron's SequentialMLP ``local_experts.{i}`` does.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_bridge_upstream import MOE  # 4 experts of 6, hidden 8, 2 layers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def megatron():
    from megarl.platform.megatron import prepare_megatron

    prepare_megatron()


@pytest.mark.parametrize("cuda, te, grouped", [(True, True, True), (True, False, False), (False, True, False),
                                               (False, False, False)])
def test_grouped_gemm_only_where_the_te_spec_runs(monkeypatch, cuda, te, grouped):
    from megarl.models import build

    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(build, "have_transformer_engine", lambda: te)
    assert build.grouped_gemm() is grouped


def test_config_asks_for_grouped_experts(megatron):
    from megarl.models.hf_config import transformer_config_from_hf

    assert transformer_config_from_hf(MOE, grouped_gemm=True).moe_grouped_gemm is True
    assert transformer_config_from_hf(MOE).moe_grouped_gemm is False


def test_the_trainer_builds_grouped_experts_where_te_runs(monkeypatch, tmp_path):
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer import megatron_trainer

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml", tmp_path / "moe")
    seen = {}

    class Stop(Exception):
        pass

    def config(hf, **kwargs):
        seen.update(kwargs)
        raise Stop  # the TE layers themselves cannot be built on CPU

    monkeypatch.setattr(megatron_trainer, "transformer_config_from_hf", config)
    for te in (True, False):
        monkeypatch.setattr(megatron_trainer, "grouped_gemm", lambda te=te: te)
        with pytest.raises(Stop):
            megatron_trainer.MegatronTrainer(str(ckpt))
        assert seen["grouped_gemm"] is te


def test_grouped_expert_names_both_ways(megatron):
    from megarl.models.bridge import canonical_name, make_bridge
    from megarl.models.hf_config import transformer_config_from_hf

    bridge = make_bridge(MOE, transformer_config_from_hf(MOE, ep=2, grouped_gemm=True))
    p = "model.layers.1.mlp.experts."
    # EP 2 of 4 experts: rank 1 holds global experts 2 and 3 as its local 0 and 1
    grouped = {f"decoder.layers.1.mlp.experts.linear_fc1.weight{i}": [f"{p}{2 + i}.gate_proj.weight",
                                                                         f"{p}{2 + i}.up_proj.weight"] for i in (0, 1)}
    grouped.update({f"decoder.layers.1.mlp.experts.linear_fc2.weight{i}": [f"{p}{2 + i}.down_proj.weight"]
                    for i in (0, 1)})
    for local, hf_names in grouped.items():
        canon = canonical_name(local, moe=True, expert_offset=2)
        assert bridge._weight_name_mapping_mcore_to_hf(canon) == hf_names, local
        # the same expert under SequentialMLP (local spec) has the same global name
        i, fc = local[-1], local.split(".")[-2]
        assert canonical_name(f"decoder.layers.1.mlp.experts.local_experts.{i}.{fc}.weight", moe=True,
                              expert_offset=2) == canon
    # megatron -> HF and back: gate and up stack into linear_fc1 (rows 6 + 6), down is linear_fc2 as it is
    gate, up, down = torch.full((6, 8), 1.0), torch.full((6, 8), 2.0), torch.arange(48.0).view(8, 6)
    fc1 = bridge._weight_to_mcore_format("decoder.layers.1.mlp.experts.linear_fc1.weight3", [gate, up])
    assert fc1.shape == (12, 8) and torch.equal(fc1, torch.cat([gate, up]))
    names, back = bridge._weight_to_hf_format("decoder.layers.1.mlp.experts.linear_fc1.weight3", fc1)
    assert names == [f"{p}3.gate_proj.weight", f"{p}3.up_proj.weight"]
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)
    names, back = bridge._weight_to_hf_format("decoder.layers.1.mlp.experts.linear_fc2.weight2", down)
    assert names == [f"{p}2.down_proj.weight"] and torch.equal(back[0], down)
