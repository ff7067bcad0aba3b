"""On CUDA the trainer needs TransformerEngine unless model.allow_local_spec is set (CUDA faked on CPU).

Without TE megatron falls back to its local layers, whose attention keeps the
full score matrices: a long row then needs tens of GB more. That fallback must
be asked for, never silent.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config():
    from megarl.models.hf_config import transformer_config_from_hf
    from megarl.trainer.parallel import init_parallel

    init_parallel(tp=1, pp=1, ep=1, seed=0)  # imports megatron (CPU patches) before CUDA is faked
    hf = yaml.safe_load((REPO / "configs/models/tiny_qwen3.yaml").read_text())
    return transformer_config_from_hf(hf)


def fake_cuda_without_te(monkeypatch):
    from megarl.models import build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "have_transformer_engine", lambda: False)


def test_cuda_without_transformer_engine_is_an_error(config, monkeypatch):
    from megarl.errors import ConfigError
    from megarl.models.build import layer_spec

    fake_cuda_without_te(monkeypatch)
    with pytest.raises(ConfigError, match=r"TransformerEngine.*--no-build-isolation.*model\.allow_local_spec=true"):
        layer_spec(config)


def test_allow_local_spec_builds_the_local_layers(config, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.models.build import layer_spec

    fake_cuda_without_te(monkeypatch)
    spec = layer_spec(config, allow_local_spec=True)
    assert spec.layer_specs[0].submodules.self_attention.submodules.core_attention is DotProductAttention
