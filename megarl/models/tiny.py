"""Random-initialized HF-format checkpoints for tests and the CPU demo.

No model hub is reachable on the machines megarl is developed on, so tiny
models are made locally from a YAML file of HF ``config.json`` fields
(``configs/models/tiny_qwen3.yaml``, ``configs/models/tiny_qwen3_moe.yaml``).
A ``tokenizer:`` section in that YAML adds a real HF tokenizer with a chat
template and a ``generation_config.json`` (megarl/models/tiny_tokenizer.py),
so a tiny checkpoint is a complete HF model directory like a downloaded one.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from megarl.config.input_paths import where_looked
from megarl.errors import ConfigError
from megarl.models.tiny_tokenizer import TinyTokenizer

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def load_model_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model config {path} does not exist{where_looked(str(path))}; pass a YAML of HF "
                          f"config.json fields such as configs/models/tiny_qwen3.yaml")
    fields = yaml.safe_load(path.read_text()) or {}
    arch = (fields.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{path}: architectures[0] is {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if int(fields.get("head_dim", 0)) < 32:
        raise ConfigError(f"{path}: head_dim {fields.get('head_dim')} < 32; vLLM's CPU attention needs head_dim >= 32")
    return fields


def write_tiny_checkpoint(model_yaml: str | Path, output_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-initialized fp32 HF checkpoint (config.json + model.safetensors) to ``output_dir``."""
    import torch  # lazy: heavy, this module also serves light callers (load_model_yaml)
    import transformers

    fields = load_model_yaml(model_yaml)
    tokenizer_section = fields.pop("tokenizer", None)
    arch = fields["architectures"][0]
    config_cls = transformers.Qwen3Config if arch == "Qwen3ForCausalLM" else transformers.Qwen3MoeConfig
    model_cls = getattr(transformers, arch)
    cfg_fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type", "torch_dtype")}
    out = Path(output_dir)
    tokenizer = None
    if tokenizer_section is not None:  # the tokenizer decides the special ids config.json names
        tokenizer = TinyTokenizer(tokenizer_section, cfg_fields, where=str(model_yaml))
        cfg_fields.update(tokenizer.config_ids())
    config = config_cls(**cfg_fields)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:  # after the model: save_pretrained may write a generation_config.json of its own
        tokenizer.save(out)
    # record where it came from, for humans
    (out / "megarl_init.json").write_text(json.dumps({"model_yaml": str(model_yaml), "seed": seed}) + "\n")
    return out
