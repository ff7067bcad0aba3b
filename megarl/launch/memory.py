"""The whole-GPU memory plan of a layout: what one trainer GPU, one engine GPU and the scorer's GPU hold at peak.

`megarl plan` prints it for ``placement.device=gpu`` and refuses a layout that
does not fit ``placement.gpu_memory_gb``, naming the settings that would.

Trainer GPU (bf16 or fp32 parameters, Megatron DDP, Adam):
- weights: the rank's parameter shard (dense parameters / (tp*pp), experts / (ep*tp*pp)) in model.dtype;
- gradients: the DDP buffer, fp32 for every parameter of the shard (``grad_reduce_in_fp32``);
- optimizer: fp32 main parameters (bf16 only) and Adam's two fp32 moments, over DP (experts: expert DP)
  with the distributed optimizer;
- activations: the measured bytes per token per layer of megarl/launch/activation_table.yaml
  (megarl/launch/activation_probe.py) under ``trainer.recompute``, times the layers of a pipeline stage,
  the micro-batches in flight on the first stage (pp under 1F1B) and the tokens of one micro-batch (at
  least the longest row: prompt + response), split over tp by sequence parallelism; full recompute keeps
  each layer's input plus one layer's activations rebuilt in the backward; what the model keeps outside its
  layers (embedding output, final norm, output-layer input: measured, once per micro-batch); the local spec
  (``model.allow_local_spec``) adds its attention score matrices (quadratic in the row length);
- logits: what the loss keeps per token and vocabulary entry (measured) plus the bf16 logits and their
  fp32 copy alive while it runs (:data:`LOGITS_TRANSIENT`); with the entropy bonus (``loss.entropy_coef``
  or ``loss.entropy_target``) also what its path keeps (measured: an fp32 copy of the logits and its graph).
- runtime: CUDA context, NCCL buffers and allocator slack (:data:`RUNTIME_RESERVE`, assumed).
Engine GPU: vLLM takes :data:`VLLM_UTILIZATION` of the device: its weight shard, the KV cache the rest.
Dedicated scorer GPU: forward-only weights (no gradients, no optimizer), one layer's activations and the
logits of one micro-batch (the scorer's micro-batches: :data:`SCORER_MICRO_BATCH_TOKENS`, at least one row).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megarl.launch.placement import param_counts

TABLE = Path(__file__).with_name("activation_table.yaml")
GB = 1e9
#: bytes per logit alive beside what the loss keeps while it runs: the bf16 logits and their fp32 copy
LOGITS_TRANSIENT = 2 + 4
#: bytes per token and vocabulary entry the entropy bonus keeps when the table has no measurement of its own
#: (an fp32 copy of the logits and exp of it: 8 B; measured values come from megarl/launch/activation_probe.py)
ENTROPY_BYTES_PER_ENTRY = 8.0
#: bytes per logit alive for a moment while the entropy is computed (x - max, then exp(.) * x: fp32, one at a time)
ENTROPY_TRANSIENT = 4
#: vLLM's default gpu_memory_utilization: the share of the device an engine takes (weights + KV cache)
VLLM_UTILIZATION = 0.9
#: CUDA context, NCCL communicators and allocator fragmentation on a trainer or scorer GPU (assumed, bytes)
RUNTIME_RESERVE = 3e9
#: micro-batch token budget of the dedicated scorer (MegatronTrainer's default, which it is built with)
SCORER_MICRO_BATCH_TOKENS = 4096
#: assumed ratio of TransformerEngine's activation bytes to the local spec's linear part (an upper bound:
#: TE fuses the norms into the next linear layer and its fused attention keeps no score matrices)
TE_FACTOR = 1.0


@dataclass
class GpuMemory:
    """One GPU's peak, by part (bytes)."""

    role: str
    parts: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.parts.items())
        return f"  {self.role}: peak {self.peak / GB:.1f} GB ({parts})" + "".join(f"; {n}" for n in self.notes)


@functools.lru_cache(maxsize=4)
def load_table(path: str = str(TABLE)) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def activation_entry(hf: dict, table: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    """(measured entry, its name, scale): the entry of the same kind (dense / moe) with the nearest hidden size,
    scaled by hidden_size when it is another model's."""
    kind = "moe" if int(hf.get("num_experts") or hf.get("num_local_experts") or 0) else "dense"
    h = int(hf["hidden_size"])
    name, entry = min(((n, e) for n, e in table["models"].items() if e["kind"] == kind),
                      key=lambda ne: abs(ne[1]["hidden_size"] - h))
    return entry, name, h / entry["hidden_size"]


def longest_row(cfg, hf: dict) -> int:
    return min(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, int(hf["max_position_embeddings"]))


def _shards(hf: dict, t) -> tuple[float, float]:
    """(dense, expert) parameters of one trainer rank."""
    total, _ = param_counts(hf)
    n_exp = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    experts = (int(hf["num_hidden_layers"]) * n_exp * 3 * int(hf["hidden_size"]) * int(hf["moe_intermediate_size"])
               if n_exp else 0)
    return (total - experts) / (t.tp * t.pp), experts / (t.ep * t.tp * t.pp)


def trainer_memory(cfg, hf: dict, t, *, recompute: str | None = None, micro_batch_tokens: int | None = None,
                   table: dict[str, Any] | None = None, entropy: bool | None = None) -> GpuMemory:
    """Peak of one trainer GPU (module doc); ``recompute`` / ``micro_batch_tokens`` / ``entropy`` (the entropy
    bonus's path) override the config's."""
    table = table or load_table()
    recompute = recompute or cfg.trainer.recompute
    row = longest_row(cfg, hf)
    tokens = max(micro_batch_tokens or cfg.trainer.micro_batch_tokens, row)
    dense, experts = _shards(hf, t)
    bf16 = cfg.model.dtype == "bfloat16"
    opt_bytes = 12 if bf16 else 8  # fp32 main params (bf16 only) + exp_avg + exp_avg_sq
    dist = cfg.parallel.use_distributed_optimizer
    entry, name, scale = activation_entry(hf, table)
    split = t.tp if t.sequence_parallel else 1
    per_token = entry[recompute]["bytes_per_token"] * scale * TE_FACTOR
    layers, in_flight = int(hf["num_hidden_layers"]) // t.pp, t.pp
    acts = layers * in_flight * per_token * tokens / split
    if recompute == "full":  # one layer's activations exist again while its backward runs
        acts += entry["none"]["bytes_per_token"] * scale * TE_FACTOR * tokens / split
    notes = [f"{recompute} recompute, {tokens} tokens per micro-batch"
             + (f", activations scaled x{scale:.2f} from {name}" if name and abs(scale - 1) > 1e-9 else "")]
    # the embedding's output, the final norm and the output layer's input: once per micro-batch in flight
    acts += in_flight * entry.get("outside_layers_bytes_per_token", 0.0) * scale * TE_FACTOR * tokens / split
    if getattr(cfg.model, "allow_local_spec", False) and recompute == "none":
        # the local spec's attention keeps [heads, s, s] per row: rows of the longest length fill a micro-batch
        acts += layers * in_flight * entry["none"]["bytes_per_token_squared"] * tokens * row / split
    vocab = int(hf["vocab_size"]) / t.tp
    per_entry = table["models"][name]["loss_bytes_per_token_per_vocab"] + LOGITS_TRANSIENT
    # the entropy bonus (megarl/models/entropy.py): an fp32 copy of the logits and its graph, kept for backward
    if entropy_bonus(cfg) if entropy is None else entropy:
        per_entry += (table["models"][name].get("entropy_bytes_per_token_per_vocab", ENTROPY_BYTES_PER_ENTRY)
                      + ENTROPY_TRANSIENT)
        notes.append("entropy bonus on (loss.entropy_coef / loss.entropy_target): its logits path counted")
    return GpuMemory("trainer GPU", {
        "weights": (dense + experts) * (2 if bf16 else 4),
        "gradients": (dense + experts) * 4,
        "optimizer": opt_bytes * (dense / (t.dp if dist else 1) + experts / (t.expert_dp if dist else 1)),
        "activations": acts,
        "logits": tokens * vocab * per_entry,
        "runtime": RUNTIME_RESERVE,
    }, notes)


def _kv_bytes_per_token(hf: dict, dtype_bytes: int, tp: int) -> float:
    heads = int(hf["num_attention_heads"])
    hd = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    return 2 * int(hf["num_hidden_layers"]) * max(int(hf["num_key_value_heads"]) / tp, 1) * hd * dtype_bytes


def engine_memory(cfg, hf: dict, engine_tp: int, gpu_bytes: float) -> GpuMemory:
    dtype_bytes = 2 if cfg.engine_dtype == "bfloat16" else 4
    weights = param_counts(hf)[0] * dtype_bytes / engine_tp
    kv = max(VLLM_UTILIZATION * gpu_bytes - weights, 0.0)
    kv_tokens = int(kv / _kv_bytes_per_token(hf, dtype_bytes, engine_tp))
    return GpuMemory("engine GPU", {"weights": weights, "KV cache": kv},
                     [f"vLLM takes {VLLM_UTILIZATION:.0%} of the GPU; KV cache for {kv_tokens:,} tokens"])


def dedicated_memory(cfg, hf: dict, table: dict[str, Any] | None = None) -> GpuMemory:
    table = table or load_table()
    tokens = max(SCORER_MICRO_BATCH_TOKENS, longest_row(cfg, hf))
    entry, _, scale = activation_entry(hf, table)
    return GpuMemory("dedicated scorer GPU", {
        "weights": param_counts(hf)[0] * (2 if cfg.model.dtype == "bfloat16" else 4),
        # no graph is kept: one layer's activations and the logits of one micro-batch at a time
        "activations": entry["none"]["bytes_per_token"] * scale * tokens,
        "logits": tokens * int(hf["vocab_size"]) * (4 + LOGITS_TRANSIENT),
        "runtime": RUNTIME_RESERVE,
    }, [f"forward-only: no gradients, no optimizer; {tokens} tokens per micro-batch"])


@dataclass
class MemoryPlan:
    gpu_bytes: float
    gpus: list[GpuMemory]
    problems: list[str]

    def describe(self) -> str:
        lines = [f"GPU memory (placement.gpu_memory_gb={self.gpu_bytes / GB:g}; activations per token and layer from "
                 f"{TABLE.name}, measured {load_table()['measured']}; TransformerEngine assumed to keep "
                 f"x{TE_FACTOR:g} of the local spec's linear part):"]
        lines += [g.line() for g in self.gpus]
        lines += [f"  DOES NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)


def _trainer_fixes(cfg, hf: dict, t, gpu_bytes: float) -> list[str]:
    """The settings that would make the trainer GPU fit: recompute and micro-batch size, one alone before both."""
    row = longest_row(cfg, hf)
    tries = [(mode, None) for mode in ("selective", "full") if mode != cfg.trainer.recompute]
    if cfg.trainer.micro_batch_tokens > row:
        tries += [(None, row)] + [(mode, row) for mode in ("selective", "full") if mode != cfg.trainer.recompute]
    fixes = []
    for mode, tokens in tries:
        peak = trainer_memory(cfg, hf, t, recompute=mode, micro_batch_tokens=tokens).peak
        if peak <= gpu_bytes and not (fixes and mode and tokens):  # a pair only when no single change fits
            said = [f"trainer.recompute={mode}"] * bool(mode) + [f"trainer.micro_batch_tokens={tokens}"] * bool(tokens)
            fixes.append(f"{' with '.join(said)} ({peak / GB:.1f} GB)")
    if entropy_bonus(cfg):
        peak = trainer_memory(cfg, hf, t, entropy=False).peak
        if peak <= gpu_bytes:
            fixes.append(f"loss.entropy_coef=0 with loss.entropy_target=null (no entropy bonus: {peak / GB:.1f} GB)")
    fixes.append("more GPUs per model copy (parallel.tp with sequence_parallel, parallel.pp, parallel.ep)")
    return fixes


def memory_plan(cfg, hf: dict, plan) -> MemoryPlan:
    """The per-GPU peaks of ``plan`` and what does not fit ``placement.gpu_memory_gb``."""
    gpu_bytes = float(cfg.placement.gpu_memory_gb) * GB
    t = plan.trainer
    gpus = [trainer_memory(cfg, hf, t)]
    problems = []
    if gpus[0].peak > gpu_bytes:
        problems.append(f"a trainer GPU needs {gpus[0].peak / GB:.1f} GB > {gpu_bytes / GB:g} GB; set "
                        + " or ".join(_trainer_fixes(cfg, hf, t, gpu_bytes)))
    for etp in sorted({s.tp for s in plan.engines} or {cfg.placement.engine_tp}):
        eng = engine_memory(cfg, hf, etp, gpu_bytes)
        gpus.append(eng)
        need = _kv_bytes_per_token(hf, 2 if cfg.engine_dtype == "bfloat16" else 4, etp) * longest_row(cfg, hf)
        if eng.parts["KV cache"] < need:
            problems.append(f"an engine of TP{etp} leaves {eng.parts['KV cache'] / GB:.1f} GB of KV cache, less "
                            f"than one longest row needs ({need / GB:.1f} GB); set placement.engine_tp higher")
    if plan.dedicated is not None:
        ded = dedicated_memory(cfg, hf)
        gpus.append(ded)
        if ded.peak > gpu_bytes:
            problems.append(f"the dedicated scorer needs {ded.peak / GB:.1f} GB > {gpu_bytes / GB:g} GB "
                            f"(one GPU holds all its weights); use another recovery strategy or GPUs with "
                            f"more memory (placement.gpu_memory_gb)")
    return MemoryPlan(gpu_bytes, gpus, problems)


def as_dict(mp: MemoryPlan) -> dict[str, Any]:
    return {"gpu_memory_gb": mp.gpu_bytes / GB, "problems": mp.problems,
            "gpus": [{**dataclasses.asdict(g), "peak": g.peak} for g in mp.gpus]}


def entropy_bonus(cfg) -> bool:
    """The loss runs the entropy path (a fixed bonus or an entropy target)."""
    return cfg.loss.entropy_coef > 0 or cfg.loss.entropy_target is not None
