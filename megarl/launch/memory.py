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
- recovery: what the recovery strategy puts on the GPU (:func:`recovery_gpu_bytes`): a strategy that swaps
  other parameters in (ewma, snapshot, interrupt_sync) has the largest tensor in fp32 there for a moment;
  ewma with ``recovery.ewma.phi_on_gpu`` keeps its phi there, which the forward points at (an fp32 phi on a
  bf16 run adds its bf16 cast while it scores).
- runtime: CUDA context, allocator slack, NCCL's communicators and, on rank 0, the weight sender's context,
  communicators and buffers (megarl/launch/runtime_reserve.py; :data:`RUNTIME_RESERVE` where no plan is given).
Engine GPU: vLLM takes :data:`VLLM_UTILIZATION` of the device: its weight shard, the KV cache the rest.
Dedicated scorer GPU: forward-only weights (no gradients, no optimizer) and, one after the other (no graph is
kept, so a layer's tensors are gone before the output layer runs), one layer's activations or the logits of one
micro-batch: the scorer's own micro-batches of ``recovery.dedicated.micro_batch_tokens``
(:func:`scorer_micro_batch_tokens`), at least one longest row. It is one GPU (a scorer across several GPUs is
not built); when even one row per micro-batch does not fit, the refusal says so.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megarl.errors import ConfigError
from megarl.launch.placement import param_counts
from megarl.launch.recovery_bytes import FP32, SWAPPING, ewma_phi
from megarl.launch.runtime_reserve import describe as describe_reserve
from megarl.launch.runtime_reserve import runtime_parts

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
#: CUDA context and allocator fragmentation on the dedicated scorer's GPU, and a trainer GPU's runtime where no
#: placement plan is given (assumed, bytes; a plan's trainer GPU counts megarl/launch/runtime_reserve.py's parts)
RUNTIME_RESERVE = 3e9
#: default of ``recovery.dedicated.micro_batch_tokens`` (recovery/_dedicated_scorer.py's DedicatedConfig takes it
#: from here, so the plan of a config without a dedicated section and the scorer agree)
SCORER_MICRO_BATCH_TOKENS = 4096
#: bytes per logit on the scorer's GPU while its loss runs: the bf16 logits and the fp32 copy megatron's cross
#: entropy works on in place (:data:`LOGITS_TRANSIENT`), plus 4 for the fp32 quotient logits.float() / T that
#: exists beside that copy for a moment at a temperature other than 1 (megarl/models/entropy.py); nothing is kept
#: for a backward
SCORER_LOGITS_BYTES = LOGITS_TRANSIENT + 4
#: assumed ratio of TransformerEngine's activation bytes to the local spec's linear part (an upper bound:
#: TE fuses the norms into the next linear layer and its fused attention keeps no score matrices)
TE_FACTOR = 1.0


@dataclass
class GpuMemory:
    """One GPU's peak, by part (bytes)."""

    role: str
    parts: dict[str, float]
    notes: list[str] = field(default_factory=list)
    #: parts never alive together (a forward without a graph): the peak counts the largest of them
    one_at_a_time: tuple[str, ...] = ()

    @property
    def peak(self) -> float:
        alone = [v for k, v in self.parts.items() if k in self.one_at_a_time]
        return sum(v for k, v in self.parts.items() if k not in self.one_at_a_time) + max(alone, default=0.0)

    def line(self) -> str:
        shown = []
        for k, v in self.parts.items():
            if k not in self.one_at_a_time:
                shown.append(f"{k} {v / GB:.1f}")
            elif k == self.one_at_a_time[0]:  # "activations 2.0 or logits 14.0": the larger one counts
                shown.append(" or ".join(f"{n} {self.parts[n] / GB:.1f}" for n in self.one_at_a_time))
        return (f"  {self.role}: peak {self.peak / GB:.1f} GB ({', '.join(shown)})"
                + "".join(f"; {n}" for n in self.notes))


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


def model_state_bytes(cfg, hf: dict, t) -> dict[str, float]:
    """One trainer rank's weights, gradients and optimizer state (module doc), bytes; ``t``: the trainer's layout."""
    dense, experts = _shards(hf, t)
    bf16 = cfg.model.dtype == "bfloat16"
    opt_bytes = 12 if bf16 else 8  # fp32 main params (bf16 only) + exp_avg + exp_avg_sq
    dist = cfg.parallel.use_distributed_optimizer
    return {"weights": (dense + experts) * (2 if bf16 else 4),
            "gradients": (dense + experts) * 4,
            "optimizer": opt_bytes * (dense / (t.dp if dist else 1) + experts / (t.expert_dp if dist else 1))}


def largest_tensor(hf: dict, tp: int) -> float:
    """Elements of a trainer rank's largest parameter tensor: the (vocab) embedding or the fused MLP, over tp."""
    h = int(hf["hidden_size"])
    return max(int(hf["vocab_size"]) * h, 3 * h * int(hf.get("intermediate_size") or 0)) / tp


def recovery_gpu_bytes(cfg, hf: dict, t, *, phi_on_gpu: bool | None = None) -> float:
    """The recovery strategy's bytes on one trainer GPU (module doc); ``phi_on_gpu`` overrides
    ``recovery.ewma.phi_on_gpu``."""

    if cfg.recovery.name not in SWAPPING:
        return 0.0
    out = largest_tensor(hf, t.tp) * FP32
    phi_b, on_gpu = ewma_phi(cfg)
    if cfg.recovery.name == "ewma" and (on_gpu if phi_on_gpu is None else phi_on_gpu):
        param_b = 2 if cfg.model.dtype == "bfloat16" else 4
        # the forward points at phi; an fp32 phi on a bf16 run is cast for it (recovery/ewma.py)
        out += sum(_shards(hf, t)) * (phi_b + (param_b if phi_b != param_b else 0))
    return out


def trainer_memory(cfg, hf: dict, t, *, recompute: str | None = None, micro_batch_tokens: int | None = None,
                   table: dict[str, Any] | None = None, entropy: bool | None = None,
                   runtime: float = RUNTIME_RESERVE) -> GpuMemory:
    """Peak of one trainer GPU (module doc); ``recompute`` / ``micro_batch_tokens`` / ``entropy`` (the entropy
    bonus's path) override the config's; ``runtime``: the runtime reserve's bytes."""
    table = table or load_table()
    recompute = recompute or cfg.trainer.recompute
    row = longest_row(cfg, hf)
    tokens = max(micro_batch_tokens or cfg.trainer.micro_batch_tokens, row)
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
        **model_state_bytes(cfg, hf, t),
        "activations": acts,
        "logits": tokens * vocab * per_entry,
        "recovery": recovery_gpu_bytes(cfg, hf, t),
        "runtime": runtime,
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


def scorer_micro_batch_tokens(cfg) -> int:
    """The dedicated scorer's micro-batch token budget: ``recovery.dedicated.micro_batch_tokens`` (its default,
    :data:`SCORER_MICRO_BATCH_TOKENS`, for a config built without the strategies' sections)."""
    options = cfg.recovery.options.get("dedicated")
    tokens = SCORER_MICRO_BATCH_TOKENS if options is None else int(options.micro_batch_tokens)
    if tokens < 1:
        raise ConfigError(f"recovery.dedicated.micro_batch_tokens must be >= 1, got {tokens}")
    return tokens


def dedicated_memory(cfg, hf: dict, table: dict[str, Any] | None = None, *,
                     micro_batch_tokens: int | None = None) -> GpuMemory:
    """Peak of the dedicated scorer's GPU (module doc); ``micro_batch_tokens`` overrides the config's budget.

    A micro-batch holds at least one longest row (a longer row is packed alone), so its tokens are
    max(budget, prompt + response); the activations and the logits are both of that many tokens."""
    table = table or load_table()
    row = longest_row(cfg, hf)
    tokens = max(micro_batch_tokens or scorer_micro_batch_tokens(cfg), row)
    entry, _, scale = activation_entry(hf, table)
    acts = entry["none"]["bytes_per_token"] * scale * TE_FACTOR * tokens
    if getattr(cfg.model, "allow_local_spec", False):  # one layer's [heads, s, s] score matrices
        acts += entry["none"]["bytes_per_token_squared"] * tokens * row
    return GpuMemory("dedicated scorer GPU", {
        "weights": param_counts(hf)[0] * (2 if cfg.model.dtype == "bfloat16" else 4),
        # no graph is kept: one layer's activations, then (they are gone) the logits of one micro-batch
        "activations": acts,
        "logits": tokens * int(hf["vocab_size"]) * SCORER_LOGITS_BYTES,
        "runtime": RUNTIME_RESERVE,
    }, [f"forward-only: no gradients, no optimizer; {tokens} tokens per micro-batch "
        f"(recovery.dedicated.micro_batch_tokens, at least one longest row)"],
        one_at_a_time=("activations", "logits"))


def _scorer_fix(cfg, hf: dict, gpu_bytes: float) -> str:
    """What would make the scorer's GPU fit: a smaller ``recovery.dedicated.micro_batch_tokens`` (the largest
    multiple of 1024 that fits, else one longest row), or, when even one row per micro-batch does not, what is
    left: the scorer is one GPU."""
    row, budget = longest_row(cfg, hf), scorer_micro_batch_tokens(cfg)
    tries = ([t for t in range(budget // 1024 * 1024, row, -1024) if t < budget] + [row]) if budget > row else []
    for tokens in tries:
        peak = dedicated_memory(cfg, hf, micro_batch_tokens=tokens).peak
        if peak <= gpu_bytes:
            return f"set recovery.dedicated.micro_batch_tokens={tokens} ({peak / GB:.1f} GB)"
    least = dedicated_memory(cfg, hf, micro_batch_tokens=row)
    return (f"even one longest row per micro-batch ({row} tokens: data.max_prompt_len + rollout.max_new_tokens) "
            f"needs {least.peak / GB:.1f} GB, its weights {least.parts['weights'] / GB:.1f} GB of it; a dedicated "
            f"scorer across several GPUs is not built; use another recovery strategy (recovery.name), GPUs with "
            f"more memory (placement.gpu_memory_gb) or shorter rows (data.max_prompt_len, rollout.max_new_tokens)")


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


def _trainer_fixes(cfg, hf: dict, t, gpu_bytes: float, runtime: float = RUNTIME_RESERVE) -> list[str]:
    """The settings that would make the trainer GPU fit: recompute and micro-batch size, one alone before both."""
    row = longest_row(cfg, hf)
    tries = [(mode, None) for mode in ("selective", "full") if mode != cfg.trainer.recompute]
    if cfg.trainer.micro_batch_tokens > row:
        tries += [(None, row)] + [(mode, row) for mode in ("selective", "full") if mode != cfg.trainer.recompute]
    fixes = []
    for mode, tokens in tries:
        peak = trainer_memory(cfg, hf, t, recompute=mode, micro_batch_tokens=tokens, runtime=runtime).peak
        if peak <= gpu_bytes and not (fixes and mode and tokens):  # a pair only when no single change fits
            said = [f"trainer.recompute={mode}"] * bool(mode) + [f"trainer.micro_batch_tokens={tokens}"] * bool(tokens)
            fixes.append(f"{' with '.join(said)} ({peak / GB:.1f} GB)")
    if entropy_bonus(cfg):
        peak = trainer_memory(cfg, hf, t, entropy=False, runtime=runtime).peak
        if peak <= gpu_bytes:
            fixes.append(f"loss.entropy_coef=0 with loss.entropy_target=null (no entropy bonus: {peak / GB:.1f} GB)")

    if cfg.recovery.name == "ewma" and ewma_phi(cfg)[1]:
        peak = (trainer_memory(cfg, hf, t, runtime=runtime).peak - recovery_gpu_bytes(cfg, hf, t)
                + recovery_gpu_bytes(cfg, hf, t, phi_on_gpu=False))
        if peak <= gpu_bytes:
            fixes.append(f"recovery.ewma.phi_on_gpu=false (phi in host memory: {peak / GB:.1f} GB)")
    fixes.append("more GPUs per model copy (parallel.tp with sequence_parallel, parallel.pp, parallel.ep)")
    return fixes


def memory_plan(cfg, hf: dict, plan) -> MemoryPlan:
    """The per-GPU peaks of ``plan`` and what does not fit ``placement.gpu_memory_gb``."""
    gpu_bytes = float(cfg.placement.gpu_memory_gb) * GB
    t = plan.trainer
    reserve = runtime_parts(cfg, plan)
    gpus = [trainer_memory(cfg, hf, t, runtime=sum(reserve.values()))]
    gpus[0].notes.append(describe_reserve(reserve))
    problems = []
    if gpus[0].peak > gpu_bytes:
        problems.append(f"a trainer GPU needs {gpus[0].peak / GB:.1f} GB > {gpu_bytes / GB:g} GB; set "
                        + " or ".join(_trainer_fixes(cfg, hf, t, gpu_bytes, sum(reserve.values()))))
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
                            f"(one GPU holds all its weights); {_scorer_fix(cfg, hf, gpu_bytes)}")
    return MemoryPlan(gpu_bytes, gpus, problems)


def as_dict(mp: MemoryPlan) -> dict[str, Any]:
    return {"gpu_memory_gb": mp.gpu_bytes / GB, "problems": mp.problems,
            "gpus": [{**dataclasses.asdict(g), "peak": g.peak} for g in mp.gpus]}


def entropy_bonus(cfg) -> bool:
    """The loss runs the entropy path (a fixed bonus or an entropy target)."""
    return cfg.loss.entropy_coef > 0 or cfg.loss.entropy_target is not None
