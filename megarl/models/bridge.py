"""HF safetensors <-> megatron GPTModel weights, through mbridge. All mbridge adaptation lives here.

mbridge 0.15.1 knows the Qwen3 / Qwen3-MoE name mapping and the tensor
layouts (q/k/v interleaved by KV group into ``linear_qkv``, gate/up stacked
into ``linear_fc1``, TP split/merge rules). megarl uses exactly those pieces
(``_weight_name_mapping_mcore_to_hf``, ``_weight_to_mcore_format``,
``_weight_to_hf_format``, ``_weight_split_across_tp``,
``_weight_merge_across_tp``) and does the I/O and the gathering itself.
The adaptations, each needed on megarl's stack:

* Local layer spec names. mbridge expects TransformerEngine's fused names;
  :func:`canonical_name` rewrites local-spec names first:
  ``input_layernorm`` -> ``self_attention.linear_qkv.layer_norm_weight``,
  dense ``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_weight`` (MoE
  keeps ``pre_mlp_layernorm``, which mbridge's MoE mapping expects), and
  ``mlp.experts.local_experts.{e}.linear_fcN.weight`` (SequentialMLP,
  ``moe_grouped_gemm=False``) -> grouped ``mlp.experts.linear_fcN.weight{e}``.
  Layer and expert indices become global (PP offset, EP offset) there too,
  the grouped experts' own ``weight{e}`` (TEGroupedMLP, ``moe_grouped_gemm``) included.
* Config. mbridge builds its own TransformerConfig from the HF config and
  reads ``rope_theta`` as a top-level attribute (transformers 5 moved it into
  ``rope_parameters``) and sets ``moe_router_pre_softmax=False`` regardless of
  ``norm_topk_prob``. megarl never uses mbridge's config or model provider:
  :class:`_ConfigFromMegarl` hands it megarl's TransformerConfig
  (megarl.models.hf_config), which gets both right. Its Qwen3-MoE bridge also
  reads ``hf_config.num_experts``, which transformers 5 writes as
  ``num_local_experts`` (AttributeError): :func:`make_bridge` sets it.
* Tied embeddings. ``Qwen2Bridge._adjust_mapping_for_shared_weights`` writes
  into the class-level ``_DIRECT_MAPPING`` dict, so after one tied model every
  later untied model in the process would map ``output_layer`` onto
  ``embed_tokens``. Each bridge here works on its own copy.
* Loading and export. mbridge's loader and exporter walk the model's own
  (TE-spec) names and its loader scatters every tensor from TP rank 0. megarl
  replaces both with :func:`load_hf_weights` (each rank reads what it needs,
  no collective) and :func:`export_hf_weights` (streaming, canonical names).
"""
from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.errors import CheckpointError
from megarl.models.hf_config import is_moe, num_experts
from megarl.models.safetensors_stream import save_file_stoppable
from megarl.trainer.parallel import global_rank

# mbridge and megatron.core are imported inside the functions that use them: megatron may be imported
# only after megarl.platform.megatron.prepare_megatron() (called when the trainer sets up its parallel groups).

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TEGroupedMLP: local index


def _mbridge_class(hf: dict):
    from mbridge.models.qwen3 import Qwen3Bridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    return Qwen3MoEBridge if is_moe(hf) else Qwen3Bridge


class _ConfigFromMegarl:
    """Mixin: use megarl's TransformerConfig and per-instance mapping dicts (see module doc)."""

    megarl_config = None

    def _build_config(self):
        return self.megarl_config

    def _adjust_mapping_for_shared_weights(self):
        # instance copy: upstream mutates the class dict (and does nothing for Qwen3-MoE)
        self._DIRECT_MAPPING = dict(type(self)._DIRECT_MAPPING)
        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"


def make_bridge(hf: dict, config, *, tp_size: int = 1, etp_size: int = 1):
    """An mbridge Qwen3/Qwen3-MoE bridge that uses ``config`` (megarl's TransformerConfig)."""
    from mbridge.core.parallel_states import ParallelStates

    base = _mbridge_class(hf)
    cls = type(f"Megarl{base.__name__}", (_ConfigFromMegarl, base), {"megarl_config": config})
    hf_ns = types.SimpleNamespace(**hf)
    hf_ns.num_experts = num_experts(hf)
    states = ParallelStates(tp_size=tp_size, etp_size=etp_size)
    return cls(hf_ns, dtype=config.params_dtype, parallel_states=states)


def canonical_name(local_name: str, *, moe: bool, layer_offset: dict[int, int] | None = None,
                   expert_offset: int = 0) -> str:
    """Local megatron parameter name -> the global TE-style name mbridge maps to HF."""
    name = local_name
    m = _LAYER.match(name)
    if m and layer_offset is not None:
        name = f"decoder.layers.{layer_offset[int(m.group(1))]}." + name[m.end():]
    name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if not moe:
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    e = _LOCAL_EXPERT.search(name)
    if e:
        return name[: e.start()] + f".mlp.experts.{e.group(2)}.weight{int(e.group(1)) + expert_offset}"
    g = _GROUPED_EXPERT.search(name)
    if g and expert_offset:
        name = name[: g.start()] + f".mlp.experts.{g.group(1)}.weight{int(g.group(2)) + expert_offset}"
    return name


def _unwrap(module):
    while hasattr(module, "module"):  # megatron DDP and Float16Module wrap the GPTModel in .module
        module = module.module
    return module


def _layer_offsets(model) -> dict[int, int]:
    """Local layer index -> global index (0-based), from megatron's 1-based layer_number."""
    decoder = getattr(model, "decoder", None)
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)} if decoder else {}


def _model_config(model_chunks):
    """The TransformerConfig the model was built with."""
    from megatron.core.utils import get_model_config

    return get_model_config(model_chunks[0])


def _ranks():
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                etp=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
                ep=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size())


def _local_params(model, hf: dict, ep_rank: int, ep_size: int):
    """(local name, canonical global name, parameter) of one model chunk, in a fixed order."""
    model = _unwrap(model)
    moe = is_moe(hf)
    offsets = _layer_offsets(model)
    per_rank = num_experts(hf) // ep_size if moe else 0
    out = []
    for name, param in model.named_parameters():
        canon = canonical_name(name, moe=moe, layer_offset=offsets, expert_offset=ep_rank * per_rank)
        out.append((name, canon, param))
    return out


# -- reading HF safetensors ---------------------------------------------------------
class HFWeights:
    """Lazy reader of an HF checkpoint directory (single ``model.safetensors`` or sharded with an index)."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.dir = Path(ckpt_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        elif single.is_file():
            self.weight_map = {name: single.name for name in self._open(single).keys()}
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self._files: dict[str, object] = {}

    def _open(self, path: Path):
        if not path.is_file():
            raise CheckpointError(f"{path}: file is missing (listed in {self.dir / 'model.safetensors.index.json'})")
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e

    def get(self, name: str) -> torch.Tensor:
        fname = self.weight_map.get(name)
        if fname is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        if fname not in self._files:
            self._files[fname] = self._open(self.dir / fname)
        try:
            return self._files[fname].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.dir / fname}: cannot read tensor {name!r} ({e})") from e


def read_hf_config(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing (expected an HF checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


@torch.no_grad()
def load_hf_weights(model_chunks, ckpt_dir: str | os.PathLike, hf: dict, config=None) -> None:
    """Copy HF weights into this rank's model chunks (no collective).

    Each rank reads (memory-mapped) the full HF tensors its own parameters
    need, converts them with mbridge and keeps its TP/EP shard.
    """
    r = _ranks()
    bridge = make_bridge(hf, config or _model_config(model_chunks), tp_size=r["tp_size"], etp_size=r["etp_size"])
    weights = HFWeights(ckpt_dir)
    for chunk in model_chunks:
        for local, canon, param in _local_params(chunk, hf, r["ep"], r["ep_size"]):
            hf_names = bridge._weight_name_mapping_mcore_to_hf(canon)
            full = bridge._weight_to_mcore_format(canon, [weights.get(n) for n in hf_names])
            expert = ".mlp.experts." in canon
            size, rank = (r["etp_size"], r["etp"]) if expert else (r["tp_size"], r["tp"])
            shard = list(bridge._weight_split_across_tp(canon, full, param, size))[rank]
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(f"{ckpt_dir}: {', '.join(hf_names)} gives shape {tuple(shard.shape)} for "
                                      f"{local}, model expects {tuple(param.shape)}")
            param.copy_(shard)


# -- export -----------------------------------------------------------------------------
def _meta(canon: str, param, tied: bool) -> dict:
    return dict(name=canon, shape=tuple(param.shape), dtype=param.dtype,
                tp=bool(getattr(param, "tensor_model_parallel", False)),
                dim=int(getattr(param, "partition_dim", -1)),
                skip=tied and canon == "output_layer.weight")


@torch.no_grad()
def export_hf_weights(model_chunks, hf: dict, config=None, *,
                      to_host: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full tensor)`` pairs of the whole model, on EVERY rank.

    A collective: every rank of the job must consume the iterator to the end,
    and every rank yields the same full (unsharded) tensors in the same order.
    Each parameter is broadcast from its pipeline stage over the PP group,
    gathered over the EP group (experts), then over the TP / expert-TP group,
    converted to HF layout by mbridge and yielded as a contiguous CPU tensor,
    one parameter at a time (peak extra memory: one full parameter).
    With tied embeddings the last stage's ``output_layer`` copy is not yielded.
    ``to_host=False``: the tensors stay where the model is and are not copied (an unsharded one is the
    parameter's own storage, valid until the next optimizer step): for ranks that only take part in the
    gathers, and for a consumer that packs them on the device itself.
    """
    from megatron.core import parallel_state as ps

    r = _ranks()
    bridge = make_bridge(hf, config or _model_config(model_chunks), tp_size=r["tp_size"], etp_size=r["etp_size"])
    tied = bool(hf.get("tie_word_embeddings", False))
    # ep offset 0: expert names carry the local index here and become global when gathered
    local = [p for chunk in model_chunks for p in _local_params(chunk, hf, 0, 1)]
    metas = [_meta(canon, param, tied) for _, canon, param in local]
    per_stage: list = [None] * r["pp_size"]
    dist.all_gather_object(per_stage, metas, group=ps.get_pipeline_model_parallel_group())
    pp_group = ps.get_pipeline_model_parallel_group()
    n_local_experts = num_experts(hf) // r["ep_size"] if is_moe(hf) else 0
    for stage, stage_metas in enumerate(per_stage):
        src = dist.get_global_rank(pp_group, stage) if r["pp_size"] > 1 else None
        for i, meta in enumerate(stage_metas):
            if stage == r["pp"]:
                tensor = local[i][2].detach()
            else:
                tensor = torch.empty(meta["shape"], dtype=meta["dtype"], device=local[0][2].device if local else None)
            if r["pp_size"] > 1:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=src, group=pp_group)
            if meta["skip"]:
                continue
            yield from _gather_and_convert(bridge, meta, tensor, r, n_local_experts, to_host)


def _gather(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _gather_and_convert(bridge, meta: dict, tensor: torch.Tensor, r: dict, n_local_experts: int, to_host: bool):
    from megatron.core import parallel_state as ps

    name = meta["name"]
    if ".mlp.experts." in name:
        per_ep = _gather(tensor, r["ep_size"], ps.get_expert_model_parallel_group())
        # EP rank e's local expert i is global expert e * n_local + i: the numbering loading uses too
        pieces = [(canonical_name(name, moe=True, expert_offset=e * n_local_experts), t) for e, t in enumerate(per_ep)]
        size, group = r["etp_size"], ps.get_expert_tensor_parallel_group()
    else:
        pieces = [(name, tensor)]
        size, group = (r["tp_size"], ps.get_tensor_model_parallel_group()) if meta["tp"] else (1, None)
    for full_name, t in pieces:
        shards = _gather(t, size, group)
        like = t.new_empty(0)
        like.tensor_model_parallel, like.partition_dim = meta["tp"], meta["dim"]
        merged = bridge._weight_merge_across_tp(full_name, shards, like) if size > 1 else shards[0]
        hf_names, hf_tensors = bridge._weight_to_hf_format(full_name, merged)
        for hf_name, hf_tensor in zip(hf_names, hf_tensors):
            yield hf_name, hf_tensor.detach().to("cpu").contiguous().clone() if to_host else hf_tensor.detach()


def save_hf_checkpoint(model_chunks, out_dir: str | os.PathLike, hf: dict, config=None) -> Path | None:
    """Write ``config.json`` + ``model.safetensors`` (collective; global rank 0 writes).

    Rank 0 holds the full model in CPU memory while writing one safetensors
    file (fine for the models megarl runs on CPU; shard for large ones).
    Returns the directory on the writing rank, None on the others.
    """
    rank = global_rank()
    tensors = {}
    for name, tensor in export_hf_weights(model_chunks, hf, config, to_host=rank == 0):
        if rank == 0:  # the others only take part in the gathers, without host copies
            tensors[name] = tensor
    if rank == 0:
        write_hf_checkpoint(tensors, out_dir, hf)
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir) if rank == 0 else None


def write_hf_checkpoint(tensors: dict, out_dir: str | os.PathLike, hf: dict,
                        should_stop: Callable[[], bool] | None = None) -> Path:
    """``model.safetensors`` (written to a temp name, then renamed) and then ``config.json``: a
    directory with config.json is complete (the checkpointer relies on that). With ``should_stop`` the file is
    written in pieces and the write stops (megarl/models/safetensors_stream.py's WriteStopped) once it says so."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    if should_stop is None:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    else:
        save_file_stoppable(tensors, tmp, metadata={"format": "pt"}, should_stop=should_stop)
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out
