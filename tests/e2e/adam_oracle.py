"""Was a resumed trainer the checkpoint's? Answered from the tensors alone, with none of megarl's own code.

Given the trainer state of the checkpoint a run resumed from (step k) and the
trainer state the resumed run wrote after its first step (step k + 1), the
second must be one AdamW step away from the first:

* every optimizer slot's step count is the checkpoint's plus one;
* the moments continue: with the gradient ``g = (m1 - b1 m0) / (1 - b1)`` that
  the first moments imply, the second moments are ``b2 v0 + (1 - b2) g^2``;
* the weights are ``w0 (1 - lr wd) - lr / (1 - b1^t) * m1 / (sqrt(v1 / (1 - b2^t)) + eps)``
  (torch's AdamW), with ``lr`` from megatron's schedule at step k + 1.

A resumed trainer that started from other weights, from fresh moments or from
another step count fails one of them: the check needs no knowledge of the
batch it trained on. :func:`to_hf` turns megatron's tensors into the HF ones
the engines load (fused qkv and gate/up split here, not by megarl's bridge),
so what a run published can be compared with the weights it trained.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

#: fp32 rounding of a step computed in another order than torch's; the updates are ~lr (1e-4..2e-3)
WEIGHT_ATOL = 1e-6


def read_torch_dist(directory: Path) -> dict:
    """Every tensor of a torch_dist checkpoint directory, whole, by its global key (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(directory), str(out))
        flat = torch.load(out, map_location="cpu", weights_only=False)
    return {k: v for k, v in flat.items() if torch.is_tensor(v)}


def unstack(tensors: dict[str, torch.Tensor], prefix: str, n_layers: int) -> dict[str, torch.Tensor]:
    """``prefix + name`` tensors under per-layer names: megatron stores ``decoder.layers.X`` of every layer as
    one tensor with the layer first (``decoder.layers.X`` of shape [n_layers, ...])."""
    out = {}
    for key, t in tensors.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name.startswith("decoder.layers."):
            assert t.shape[0] == n_layers, (key, tuple(t.shape))
            rest = name[len("decoder.layers."):]
            out.update({f"decoder.layers.{i}.{rest}": t[i] for i in range(n_layers)})
        else:
            out[name] = t
    return out


def trainer_state(step_dir: Path) -> dict:
    """The trainer state of a run checkpoint (one trainer rank, megatron's plain optimizer): its parameters,
    AdamW slots, step count, version and dtype, read with torch alone."""
    trainer = Path(step_dir) / "trainer"
    small = torch.load(trainer / "megarl_trainer.pt", map_location="cpu", weights_only=False)
    common = torch.load(trainer / "common.pt", map_location="cpu", weights_only=False)
    flat = read_torch_dist(trainer)
    n_layers = max(t.shape[0] for k, t in flat.items() if k.startswith("decoder.layers."))
    p = unstack(flat, "", n_layers)
    opt = common.get("optimizer", {})
    opt = opt["optimizer"] if isinstance(opt.get("optimizer"), dict) else opt  # a mixed-precision one nests it
    step = float(opt.get("state", {}).get("common_step", 0.0))
    m, v = unstack(flat, "optimizer.state.exp_avg.", n_layers), unstack(flat, "optimizer.state.exp_avg_sq.", n_layers)
    params_ = {k: t for k, t in p.items() if not k.startswith("optimizer.")}
    return {"params": params_, "adam": {k: {"step": step, "m": m[k], "v": v[k]} for k in m},
            "main": unstack(flat, "optimizer.state.fp32_param.", n_layers),
            "version": small["version"], "dtype": small["dtype"], "n_layers": n_layers}


def strategy_state(step_dir: Path) -> dict:
    """Rank 0's recovery-strategy state of a run checkpoint, its copies of the weights filled in from the
    torch_dist files under the names :func:`params` uses (read with torch alone)."""
    strategy = Path(step_dir) / "strategy"
    rest = torch.load(strategy / "rank0.pt", map_location="cpu", weights_only=False)["rest"]
    flat = read_torch_dist(strategy / "sharded") if (strategy / "sharded").is_dir() else {}

    def fill(node):
        if isinstance(node, dict) and "__megarl_param_dict__" in node:
            prefix = f"strategy/{node['__megarl_param_dict__']}/"
            mine = {k: t for k, t in flat.items() if k.startswith(prefix)}
            n_layers = max(t.shape[0] for k, t in mine.items() if k.startswith(prefix + "decoder.layers."))
            return unstack(mine, prefix, n_layers)
        return {k: fill(v) for k, v in node.items()} if isinstance(node, dict) else node

    return fill(rest)


def params(state: dict) -> dict[str, torch.Tensor]:
    """Megatron names (per layer, as the checkpoint keys them) -> tensors of a trainer state."""
    return state["params"]


def adam_slots(state: dict) -> dict[str, dict]:
    """Parameter name -> its AdamW state (step, exp_avg, exp_avg_sq); the checkpoint keys the moments by
    the parameter's own name."""
    assert state["adam"].keys() == state["params"].keys(), sorted(state["adam"].keys() ^ state["params"].keys())[:4]
    for name, slot in state["adam"].items():
        assert slot["m"].shape == state["params"][name].shape, name
    return state["adam"]


def megatron_lr(num_steps: int, *, lr: float, min_lr: float, decay: str, total_steps: int) -> float:
    """megatron's OptimizerParamScheduler.get_lr without warm-up; the trainer sets ``num_steps`` to
    the version before the step plus one."""
    if decay == "constant":
        return lr
    if num_steps > total_steps:
        return min_lr
    ratio = num_steps / total_steps
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if decay == "cosine" else 1.0 - ratio
    return min_lr + coeff * (lr - min_lr)


def one_adam_step(before: dict, after: dict, *, lr: float, betas, eps: float, weight_decay: float) -> dict:
    """The weights one AdamW step from ``before`` leads to, given ``after``'s moments; asserts that the
    step counts and the moments continue those of ``before``."""
    b1, b2 = betas
    w0, s0, s1 = params(before), adam_slots(before), adam_slots(after)
    assert s0.keys() == s1.keys() == w0.keys()
    out = {}
    for name, a in s1.items():
        o = s0[name]
        assert a["step"] == o["step"] + 1, f"{name}: optimizer step {a['step']} after {o['step']}"
        g = (a["m"].double() - b1 * o["m"].double()) / (1 - b1)
        v_want = b2 * o["v"].double() + (1 - b2) * g * g
        err = (a["v"].double() - v_want).abs().max().item()
        scale = a["v"].double().abs().max().item()
        assert err <= 1e-4 * scale, f"{name}: second moments do not continue the checkpoint's ({err:.3g}, {scale:.3g})"
        t = a["step"]
        denom = a["v"].double().sqrt() / math.sqrt(1 - b2 ** t) + eps
        out[name] = (w0[name].double() * (1 - lr * weight_decay)
                     - lr / (1 - b1 ** t) * a["m"].double() / denom).float()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:4]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def to_hf(p: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """A dense Qwen3's megatron tensors under HF names, as an engine loads them."""
    heads, groups, hidden = hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
    hd = hf.get("head_dim") or hidden // heads
    q_rows = heads // groups * hd
    out = {"model.embed_tokens.weight": p["embedding.word_embeddings.weight"],
           "model.norm.weight": p["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in p:
        out["lm_head.weight"] = p["output_layer.weight"]
    for i in range(hf["num_hidden_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        # per query group: its query heads, then one key head, then one value head
        q, k, v = p[m + "self_attention.linear_qkv.weight"].reshape(groups, q_rows + 2 * hd, hidden).split(
            [q_rows, hd, hd], dim=1)
        gate, up = p[m + "mlp.linear_fc1.weight"].chunk(2)
        out.update({h + "self_attn.q_proj.weight": q.reshape(-1, hidden),
                    h + "self_attn.k_proj.weight": k.reshape(-1, hidden),
                    h + "self_attn.v_proj.weight": v.reshape(-1, hidden),
                    h + "self_attn.o_proj.weight": p[m + "self_attention.linear_proj.weight"],
                    h + "self_attn.q_norm.weight": p[m + "self_attention.q_layernorm.weight"],
                    h + "self_attn.k_norm.weight": p[m + "self_attention.k_layernorm.weight"],
                    h + "input_layernorm.weight": p[m + "self_attention.linear_qkv.layer_norm_weight"],
                    h + "post_attention_layernorm.weight": p[m + "mlp.linear_fc1.layer_norm_weight"],
                    h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                    h + "mlp.down_proj.weight": p[m + "mlp.linear_fc2.weight"]})
    return out


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of an HF model directory."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no safetensors in {directory}"
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_resumed_from(before: Path, after: Path, hf: dict, config: Path, *, total_steps: int) -> dict:
    """``after`` (the resumed run's checkpoint one step later) holds the state one AdamW step from ``before``
    (the checkpoint it resumed from; trainer settings of the YAML ``config``, Adam's eps at its default),
    and the weights it published as that version are the ones it trained. Returns those weights (HF names)."""
    trainer = yaml.safe_load(Path(config).read_text())["trainer"]
    s0, s1 = trainer_state(before), trainer_state(after)
    k = s0["version"]
    manifest = json.loads((Path(before) / "manifest.json").read_text())
    if manifest["engine_version"] == k:  # a run's last checkpoint can hold the engines' version before its last step
        assert equal(to_hf(params(s0), hf), hf_tensors(Path(before) / "engine_weights")), \
            "the checkpoint's engine weights are its trainer's"
    else:
        assert manifest["engine_version"] < k, manifest
    lr = megatron_lr(k + 1, lr=trainer["lr"], min_lr=trainer.get("min_lr", 0.0),
                     decay=trainer.get("lr_decay", "constant"), total_steps=total_steps)
    want = one_adam_step(s0, s1, lr=lr, betas=trainer["betas"], eps=1e-8,
                         weight_decay=trainer.get("weight_decay", 0.0))
    moved, err = max_diff(params(s0), params(s1)), max_diff(want, params(s1))
    assert err <= WEIGHT_ATOL < moved / 100, f"the resumed step is not one AdamW step from {before}: " \
                                             f"off by {err:.3g} (the step moved weights by up to {moved:.3g})"
    published = hf_tensors(Path(after) / "engine_weights")  # weights/v{k+1}, linked: what the engines loaded
    err = max_diff(to_hf(want, hf), published)
    assert err <= WEIGHT_ATOL, f"the resumed run published weights {err:.3g} away from the ones it trained"
    return published
