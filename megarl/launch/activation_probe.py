"""Measure the activation bytes a training forward keeps, per token and per layer: the table `megarl plan` reads.

``python -m megarl.launch.activation_probe --out megarl/launch/activation_table.yaml``
builds slices of real models (the HF config of configs/models/NAME.yaml with
1 and 2 layers, a small vocabulary) in bf16 with the layer spec this machine
uses (megatron's local spec on CPU), runs one forward with labels in training
mode under each ``trainer.recompute`` and counts the bytes of every tensor
autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``;
each storage once, parameters excluded). The two-layer minus the one-layer
count is one layer's; two sequence lengths separate the part linear in the
tokens from the attention score matrices of the local spec (quadratic in the
row length; TransformerEngine's fused attention keeps none). A run with two
vocabulary sizes gives the bytes the loss keeps per token and vocabulary entry
(and, returning the entropy, what the entropy bonus's path keeps on top),
and the one-layer slice less its layer and its loss what the model keeps
outside its layers (embedding output, final norm, output-layer input).

MoE slices have :data:`PROBE_EXPERTS` experts (with the real top-k and expert
width: what a token keeps goes through top-k experts whatever their number;
128 real-size experts do not fit a small machine's memory twice over); the
router's per-expert bytes (logits and probabilities over all experts) come
from a second run with twice the experts and are added for the real count.
"""
from __future__ import annotations

import argparse
import datetime
import gc
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "selective", "full")
SMALL_VOCAB = 512
PROBE_EXPERTS = 16


def saved_bytes(model, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward with labels."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    gc.collect()  # the previous slice's model
    n = tokens.shape[1] - 1
    positions = torch.arange(n).unsqueeze(0)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=tokens[:, :-1], position_ids=positions, attention_mask=None, labels=tokens[:, 1:])
    del out
    return sum(seen.values())


def build(hf: dict, recompute: str):
    from megatron.core.transformer.module import Float16Module

    from megarl.models.build import build_gpt_model
    from megarl.models.hf_config import transformer_config_from_hf

    config = transformer_config_from_hf(hf, dtype=torch.bfloat16, recompute=recompute)
    return Float16Module(config, build_gpt_model(hf, config))


def slice_bytes(hf: dict, mode: str, tokens: torch.Tensor) -> tuple[int, int]:
    """Bytes the one-layer and the two-layer slice keep for ``tokens``."""
    one, two = (saved_bytes(build(dict(hf, num_hidden_layers=n), mode), tokens) for n in (1, 2))
    return one, two


def layer_bytes(hf: dict, mode: str, tokens: torch.Tensor) -> int:
    """Bytes one layer keeps for ``tokens``: the two-layer slice's count minus the one-layer slice's."""
    one, two = slice_bytes(hf, mode, tokens)
    return two - one


def one_layer_hf(hf: dict) -> dict:
    return dict(hf, num_hidden_layers=1)


def entropy_bytes_per_vocab(hf: dict, tokens: torch.Tensor, v1: int, v2: int) -> float:
    """Bytes the entropy bonus's path (megarl/models/entropy.py: an fp32 copy of the logits and its graph) keeps
    per token and vocabulary entry: with the entropy returned less without, at two vocabulary sizes."""
    from megarl.models import entropy

    extra = []
    for v in (v1, v2):
        plain = saved_bytes(build(dict(hf, vocab_size=v), "none"), tokens)
        model = build(dict(hf, vocab_size=v), "none")  # build_gpt_model installs the entropy path
        with entropy.returning_entropy([model]):
            extra.append(saved_bytes(model, tokens) - plain)
    return (extra[1] - extra[0]) / (tokens.shape[1] - 1) / (v2 - v1)


def measure(hf: dict, seqs: tuple[int, int] = (128, 256)) -> dict[str, Any]:
    """Per-layer bytes per token (and per token squared) under each recompute mode, and the loss's bytes."""
    from megarl.models.hf_config import is_moe, num_experts

    torch.manual_seed(0)
    small = dict(hf, vocab_size=SMALL_VOCAB, tie_word_embeddings=False)
    tokens = {s: torch.randint(1, SMALL_VOCAB, (1, s + 1)) for s in seqs}
    out: dict[str, Any] = {}
    router = 0.0
    if is_moe(hf):
        small.pop("num_local_experts", None)
        small["num_experts"] = PROBE_EXPERTS
        s = seqs[0]
        more = layer_bytes(dict(small, num_experts=2 * PROBE_EXPERTS), "none", tokens[s])
        router = (more - layer_bytes(small, "none", tokens[s])) / s / PROBE_EXPERTS
        out["probe_experts"] = PROBE_EXPERTS
        out["router_bytes_per_token_per_expert"] = round(router, 2)
    for mode in MODES:
        layer = {s: layer_bytes(small, mode, tokens[s]) for s in seqs}
        (s1, s2), (b1, b2) = seqs, (layer[seqs[0]], layer[seqs[1]])
        # b(s) = linear * s + quadratic * s^2, solved from the two lengths
        quadratic = (b2 / s2 - b1 / s1) / (s2 - s1)
        # full recompute keeps the layer input only: no router tensors
        extra = 0.0 if mode == "full" else router * (num_experts(hf) - PROBE_EXPERTS) if is_moe(hf) else 0.0
        out[mode] = {"bytes_per_token": round(b1 / s1 - quadratic * s1 + extra, 1),
                     "bytes_per_token_squared": round(max(quadratic, 0.0), 3)}
    s = seqs[0]
    one = one_layer_hf(small)
    v1, v2 = SMALL_VOCAB, 4 * SMALL_VOCAB
    toks = torch.randint(1, v1, (1, s + 1))
    b_small = saved_bytes(build(dict(one, vocab_size=v1), "none"), toks)
    b_large = saved_bytes(build(dict(one, vocab_size=v2), "none"), toks)
    loss_per_vocab = (b_large - b_small) / s / (v2 - v1)
    out["loss_bytes_per_token_per_vocab"] = round(loss_per_vocab, 3)
    out["entropy_bytes_per_token_per_vocab"] = round(entropy_bytes_per_vocab(one_layer_hf(small), toks, v1, v2), 3)
    # outside the layers: the embedding's output, the final norm and the output layer's input (a one-layer
    # slice less its layer and its loss), kept once per micro-batch whatever the depth
    one, two = slice_bytes(small, "none", tokens[s])
    outside = (2 * one - two) / s - SMALL_VOCAB * loss_per_vocab
    out["outside_layers_bytes_per_token"] = round(max(outside, 0.0), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from megarl.models.hf_config import is_moe
    from megarl.trainer.parallel import init_parallel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3_4b,qwen3_30b_a3b", help="names under configs/models/")
    p.add_argument("--out", default=str(REPO / "megarl/launch/activation_table.yaml"))
    args = p.parse_args(argv)
    init_parallel(tp=1, pp=1, ep=1, seed=0)
    table: dict[str, Any] = {}
    for name in args.models.split(","):
        hf = yaml.safe_load((REPO / "configs/models" / f"{name}.yaml").read_text())
        entry = {"kind": "moe" if is_moe(hf) else "dense", "hidden_size": int(hf["hidden_size"]), **measure(hf)}
        table[name] = entry
        print(name, entry, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"measured": datetime.date.today().isoformat(),
           "how": f"python -m megarl.launch.activation_probe on {device} (module doc of megarl/launch/"
                  f"activation_probe.py): bf16, local layer spec, tp=pp=ep=1, 1- and 2-layer slices of the real "
                  f"shapes (MoE: {PROBE_EXPERTS} and {2 * PROBE_EXPERTS} experts, router bytes extrapolated to the "
                  f"real count), one row of 128 and 256 tokens, bytes of the tensors autograd saves",
           "models": table}
    Path(args.out).write_text(yaml.safe_dump(doc, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
