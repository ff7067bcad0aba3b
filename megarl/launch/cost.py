"""A cost model of the recovery strategies for a placement plan: `megarl plan --cost`.

From the config, the model and the plan it predicts, per strategy, what the
strategy adds to a run: memory (per trainer GPU, per trainer host, dedicated
GPUs), forward FLOPs per step and the trainer seconds they take, host<->GPU
bytes per trainer GPU per step, bytes over the network per publish, and the
engine stall per publish. It models what megarl's strategies do (recovery/*.py):

- every kept copy of parameters is a CPU copy of a trainer rank's shard in the
  forward's dtype (``trainer.get_params``: bf16 on bf16 runs, exact): snapshot keeps the versions a
  batch spans (eta+1 at most), interrupt_sync one version; ewma keeps its phi in the forward's dtype
  too (bf16 rounded stochastically; ``recovery.ewma.phi_dtype=float32``: fp32), on the host or, with
  ``recovery.ewma.phi_on_gpu``, on the trainer's GPU (:func:`ewma_phi`); a scoring forward under other
  parameters swaps them in and back (``trainer.use_params``: one more copy in host memory, 3 shard
  copies over PCIe, and the largest tensor once in fp32 on the GPU; snapshot's restores from its kept copy
  of the current version when it holds one, in host memory with trainer.publish_every=1: 2 shard copies
  and no copy saved; a phi on the GPU is folded in place and pointed at by the forward: nothing copied,
  nothing over PCIe); ewma folds a host phi on the GPU during its swap (4 shard copies: theta out and
  back, phi in and out; no host arithmetic); swaps run synchronously, on the critical path; the copy
  snapshot and interrupt_sync keep of each published version
  (``trainer.keep_params``: reused pinned buffers, a side stream; megarl/trainer/host_copies.py) overlaps
  the next update and reaches the critical path only by what it takes beyond that update;
- recompute, ewma and interrupt_sync run one forward over the batch per step,
  snapshot one per distinct version over the rows holding it (a row spliced
  over two versions is scored twice), dedicated one on its own GPUs, and
  loglinear / linear one only when the loss's token count needs the anchor
  (loss.denominator=kept under a bounded mis/mask); behav none;
- every publish sends each engine the weights once: with ``rollout.shard_weight_sync`` (vLLM engines of
  placement.engine_tp > 1 workers) each worker receives only its slices, the replicated tensors (norms,
  router gates, KV heads shared by ranks) once per worker (megarl/rollout/engine_shards.py); without it
  every worker receives the full tensors; dedicated also writes an HF checkpoint for its scorer, inside
  the publish; snapshot and interrupt_sync copy the new version to host memory
  inside the publish; interrupt_sync also scores the tokens still in flight;
- the dedicated scorer's own costs: its GPU's peak (megarl/launch/memory.py: forward-only
  weights, one layer's activations, one micro-batch's logits, the runtime reserve; no gradients,
  no optimizer), the bytes it reads per publish (its checkpoint), its forward seconds per step
  and the part of them on the critical path: the scorer runs beside the trainer, so a step
  waits only for what its busy time (forward, plus loading each version) exceeds the trainer's
  update (forward and backward over the batch: three forwards' FLOPs on the trainer's GPUs;
  a step that lasts longer, bound by generation, hides more).

Assumptions (:class:`Assumptions`, printed with every table) set the link
bandwidths, peak FLOP/s and MFU, the fixed part of a publish stall, the mean
sequence length, distinct versions per batch and the spliced fraction. The
CPU form of the same model (:func:`predict_cpu`) is calibrated on a
`megarl bench --sweep` report (:func:`fit_cpu_constants`), which gives its
constants and predicted against measured costs of the CPU sizes
(`megarl plan --calibrate REPORT`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from megarl.launch.fit import nonneg_lstsq
from megarl.launch.memory import dedicated_memory, largest_tensor
from megarl.launch.placement import param_counts
from megarl.launch.recovery_bytes import FP32, SWAPPING, ewma_phi, snapshot_storage
from megarl.rollout.engine_shards import hf_tensor_shapes, sent_elements, vllm_tp_rule

STRATEGIES = ("behav", "loglinear", "linear", "recompute", "ewma", "snapshot", "interrupt_sync", "dedicated")


@dataclass
class Assumptions:
    """What the GPU predictions assume; every field can be set from `megarl plan --cost` flags."""

    link_gb_s: float = 25.0
    """Trainer -> engines weight broadcast bandwidth, GB/s (NCCL over 400 Gb/s InfiniBand, ~50% of line rate)."""
    pcie_gb_s: float = 25.0
    """Host <-> GPU copy bandwidth per GPU, GB/s (PCIe Gen5 x16, pinned memory, ~40% of peak for unpinned)."""
    disk_gb_s: float = 2.0
    """Shared-disk write and read bandwidth of the dedicated scorer's checkpoints, GB/s."""
    peak_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s of one GPU (H100 SXM)."""
    mfu: float = 0.4
    """Model FLOPs utilization of a scoring forward."""
    stall_floor_s: float = 0.05
    """Fixed part of a publish stall: abort, drain, engine reload bookkeeping, cache reset, resume."""
    prompt_frac: float = 0.5
    """Mean prompt length as a fraction of data.max_prompt_len."""
    response_frac: float = 0.5
    """Mean response length as a fraction of rollout.max_new_tokens."""
    versions_per_batch: float = 0.0
    """Distinct policy versions in a batch; 0 = eta + 1 (the bound)."""
    spliced_frac: float = 0.4
    """Fraction of rows spliced over two versions (snapshot scores them twice)."""


def layout(cfg, hf: dict, plan) -> dict[str, Any]:
    """Model and placement facts the formulas use."""
    total, active = param_counts(hf)
    layers, h = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    n_exp = int(hf.get("num_experts") or 0)
    experts = layers * n_exp * 3 * h * int(hf["moe_intermediate_size"]) if n_exp else 0
    t = plan.trainer
    shard = (total - experts) / (t.tp * t.pp) + experts / (t.ep * t.tp * t.pp)
    largest = largest_tensor(hf, t.tp)
    cut = cfg.rollout.shard_weight_sync and cfg.rollout.backend == "vllm"
    received = {etp: sent_elements(hf_tensor_shapes(hf), vllm_tp_rule(hf, etp), etp) if cut and etp > 1
                else total * etp for etp in {s.tp for s in plan.engines}}
    return {"params": total, "active_params": active, "shard_params": shard, "largest_tensor": largest,
            # elements every engine receives per publish, summed over the engines; one engine's cut export
            "published_params": sum(received[s.tp] for s in plan.engines) or total * cfg.rollout.n_engines,
            "cut_params": max((v for etp, v in received.items() if cut and etp > 1), default=0),
            "dtype_bytes": 2 if cfg.model.dtype == "bfloat16" else FP32, "trainer_gpus": t.world_size,
            "ranks_per_node": t.ranks_per_node, "trainer_nodes": len(t.hosts),
            "engine_workers": sum(s.tp for s in plan.engines) or cfg.rollout.n_engines,
            "dedicated_gpus": max(cfg.placement.dedicated_tp, 1)}


def step_tokens(cfg, a: Assumptions) -> float:
    """Prompt + response tokens of one batch."""
    return cfg.trainer.batch_size * (a.prompt_frac * cfg.data.max_prompt_len + a.response_frac
                                     * cfg.rollout.max_new_tokens)


def strategy_costs(cfg, hf: dict, plan, a: Assumptions, *, interpolation_forward: bool = False,
                   table: dict[str, Any] | None = None) -> dict[str, dict]:
    """Per strategy (:data:`STRATEGIES`): the predicted extra costs (module doc); bytes in bytes, time in s.
    ``table``: the activation table of the scorer's memory (megarl/launch/memory.py; default the measured one)."""
    lay = layout(cfg, hf, plan)
    eta, every = cfg.rollout.eta, cfg.trainer.publish_every
    # a kept version is a copy in the forward's dtype (trainer.get_params); ewma's phi: ewma_phi
    shard_b = lay["shard_params"] * lay["dtype_bytes"]
    phi_b, phi_on_gpu = ewma_phi(cfg)
    phi = lay["shard_params"] * phi_b
    tokens = step_tokens(cfg, a)
    fwd = 2.0 * lay["active_params"] * tokens
    versions = a.versions_per_batch or eta + 1
    rate = lay["trainer_gpus"] * a.peak_tflops * 1e12 * a.mfu
    pcie, link, disk = a.pcie_gb_s * 1e9, a.link_gb_s * 1e9, a.disk_gb_s * 1e9
    weights = lay["params"] * lay["dtype_bytes"]
    publish_bytes = lay["published_params"] * lay["dtype_bytes"]
    base_stall = a.stall_floor_s + weights / link
    in_flight = min(cfg.rollout.max_concurrency, (eta + 1) * cfg.trainer.batch_size)
    live_tokens = in_flight * (a.prompt_frac * cfg.data.max_prompt_len + a.response_frac
                               * cfg.rollout.max_new_tokens / 2)  # half-way through their answers
    swap = 3 * shard_b  # save the current shard, load the other one, restore (host <-> GPU)
    # snapshot restores the current shard from its kept copy when the current version is kept (published every
    # step, held in host memory: recovery/snapshot.py): load the other one and restore, nothing saved
    snap_kept = every == 1 and snapshot_storage(cfg) == "cpu"
    swap_snapshot = 2 * shard_b if snap_kept else swap
    # ewma (recovery/ewma.py, "Folding"): theta out and back, phi in, and the phi folded on the GPU back out;
    # a phi on the GPU: no PCIe
    swap_phi = 0.0 if phi_on_gpu else 2 * shard_b + 2 * phi
    per = {
        # name: (held copies, forward FLOPs on the trainer, FLOPs on dedicated GPUs, swaps per step,
        #        shard copies to host per step, extra stall s per publish, extra bytes per publish)
        "behav": (0, 0.0, 0.0, 0, 0, 0.0, 0),
        "loglinear": (0, fwd if interpolation_forward else 0.0, 0.0, 0, 0, 0.0, 0),
        "linear": (0, fwd if interpolation_forward else 0.0, 0.0, 0, 0, 0.0, 0),
        "recompute": (0, fwd, 0.0, 0, 0, 0.0, 0),
        "ewma": (1, fwd, 0.0, 1, 0, 0.0, 0),
        "snapshot": (versions, fwd * (1 + a.spliced_frac), 0.0, versions - 1, 1 / every, 0.0, 0),
        "interrupt_sync": (1, fwd, 0.0, 2, 1 / every,
                           swap / pcie + 2.0 * lay["active_params"] * live_tokens / rate, 0),
        # its checkpoint is written inside the publish (on_weights_published) and read by the scorer after
        "dedicated": (0, 0.0, fwd, 0, 0, weights / disk, 2 * weights),
    }
    scorer = dedicated_memory(cfg, hf, table)
    train_s = 3 * fwd / rate  # the trainer's update over the batch: forward + backward
    load_s = weights / disk  # the scorer reads each version's checkpoint before it scores with it
    out = {}
    for name, (held, flops, ded_flops, swaps, to_host, stall_extra, extra_bytes) in per.items():
        swapped = swaps * {"ewma": swap_phi, "snapshot": swap_snapshot}.get(name, swap)  # PCIe bytes of its swaps
        transient = 1 if name in SWAPPING and not (name == "snapshot" and snap_kept) else 0  # the saved copy
        on_gpu = name == "ewma" and phi_on_gpu  # phi on the GPU, not the host: the forward points at it
        ded_s = ded_flops / (lay["dedicated_gpus"] * a.peak_tflops * 1e12 * a.mfu)
        ded = name == "dedicated"
        out[name] = {
            "gpu_bytes_per_trainer_gpu": (lay["largest_tensor"] * FP32 if name in SWAPPING else 0.0)
            + (phi + (shard_b if phi_b != lay["dtype_bytes"] else 0.0) if on_gpu else 0.0),
            "host_bytes_per_trainer_node": 0.0 if on_gpu else (held * (phi if name == "ewma" else shard_b)
                                                               + transient * shard_b) * lay["ranks_per_node"],
            "held_copies": held,
            "dedicated_gpus": lay["dedicated_gpus"] if name == "dedicated" else 0,
            "dedicated_gpu_bytes": scorer.peak if ded else 0.0,
            "dedicated_weights_bytes": scorer.parts["weights"] if ded else 0.0,
            "dedicated_bytes_per_publish": weights if ded else 0.0,
            "forward_flops_per_step": flops + ded_flops,
            "trainer_forward_s_per_step": flops / rate,
            "dedicated_forward_s_per_step": ded_s,
            "dedicated_load_s_per_publish": load_s if ded else 0.0,
            "dedicated_critical_s_per_step": max(ded_s + load_s / every - train_s, 0.0) if ded else 0.0,
            "pcie_bytes_per_gpu_per_step": swapped + to_host * shard_b,
            "pcie_s_per_step": (swapped + to_host * shard_b) / pcie,
            # a kept version's copy (snapshot, interrupt_sync) overlaps the next update (module doc)
            "pcie_critical_s_per_step": swapped / pcie
            + (to_host * max(shard_b / pcie - train_s, 0.0) if name in ("snapshot", "interrupt_sync") else 0.0),
            "network_bytes_per_publish": publish_bytes + extra_bytes,
            "stall_s_per_publish": base_stall + stall_extra,
        }
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def render_costs(costs: dict[str, dict], lay: dict[str, Any], cfg, a: Assumptions, title: str) -> str:
    """The table `megarl plan --cost` prints, with the layout and every assumption."""
    lines = [f"Cost model: {title}",
             f"  model: {lay['params'] / 1e9:.2f}B parameters ({lay['active_params'] / 1e9:.2f}B active), "
             f"{lay['dtype_bytes']} bytes each; trainer {lay['trainer_gpus']} GPUs on {lay['trainer_nodes']} node(s) "
             f"({lay['ranks_per_node']} per node, {lay['shard_params'] / 1e9:.3f}B parameters per GPU); "
             f"{lay['engine_workers']} engine GPU(s); eta {cfg.rollout.eta}, batch {cfg.trainer.batch_size}, "
             f"{step_tokens(cfg, a):,.0f} tokens per step",
             "  assumptions: " + ", ".join(f"{k}={v:g}" for k, v in asdict(a).items()),
             "", "| strategy | GPU GB / trainer GPU | host GB / trainer node | dedicated scorer | "
             "fwd TFLOP / step | trainer fwd s / step | PCIe GB / GPU / step | PCIe s / step (on the critical path) | "
             "network GB / publish | stall s / publish |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in costs.items():
        ded = (f"{c['dedicated_gpus']} GPU, peak {_gb(c['dedicated_gpu_bytes'])} GB (weights "
               f"{_gb(c['dedicated_weights_bytes'])}, no gradients or optimizer); fwd "
               f"{c['dedicated_forward_s_per_step']:.3f} s / step, {c['dedicated_critical_s_per_step']:.3f} on the "
               f"critical path; {_gb(c['dedicated_bytes_per_publish'])} GB read / publish"
               if c["dedicated_gpus"] else "-")
        lines.append(f"| {name} | {_gb(c['gpu_bytes_per_trainer_gpu'])} | {_gb(c['host_bytes_per_trainer_node'])} | "
                     f"{ded} | {c['forward_flops_per_step'] / 1e12:.1f} | {c['trainer_forward_s_per_step']:.3f} | "
                     f"{_gb(c['pcie_bytes_per_gpu_per_step'])} | {c['pcie_s_per_step']:.2f} "
                     f"({c['pcie_critical_s_per_step']:.2f}) | "
                     f"{_gb(c['network_bytes_per_publish'])} | "
                     f"{c['stall_s_per_publish']:.2f} |")
    return "\n".join(lines)


# -- the CPU form, calibrated on a sweep ------------------------------------------------------------
@dataclass
class CpuConstants:
    """Constants of the CPU model, fitted on a `megarl bench --sweep` report by :func:`fit_cpu_constants`."""

    forward_call_s: float
    """Fixed seconds of one scoring forward call (dispatch, micro-batching)."""
    flops_per_s: float
    """Effective forward FLOP/s of the trainer (2 x active parameters x tokens per forward)."""
    copy_bytes_per_s: float
    """Parameter copy bandwidth (get_params, use_params), bytes/s."""
    stall_floor_s: float
    """Fixed seconds of a publish stall."""
    publish_bytes_per_s: float
    """Weights bytes per second through a publish (write, engine load)."""


def _recovery_terms(row: dict[str, Any]) -> list[float] | None:
    """[forward calls, FLOPs, bytes copied] of one anchor() of a sweep row (None: the strategy runs none)."""
    p32, flops = row["params"] * FP32, 2.0 * row["active_params"]
    s = row["strategy"]
    if s == "recompute":
        return [1.0, flops * row["seq_tokens_mean"], 0.0]
    if s == "ewma":
        return [1.0, flops * row["seq_tokens_mean"], 3.0 * p32]
    if s == "snapshot":
        return [row["distinct_versions_mean"], flops * row["version_seq_tokens_mean"], 3.0 * p32
                * row["stale_versions_mean"]]
    return None


def _hook_copy_bytes(row: dict[str, Any]) -> float:
    """Parameters copied inside a publish by the strategy's on_weights_published (host copies)."""
    return row["params"] * FP32 if row["strategy"] in ("snapshot", "interrupt_sync") else 0.0


def fit_cpu_constants(report: dict[str, Any]) -> CpuConstants:
    """Least squares (non-negative) on the sweep's rows: recovery seconds of recompute, ewma and snapshot
    against [forward calls, FLOPs, bytes copied]; publish stall of the strategies without publish work
    (behav, loglinear, linear, recompute, ewma) against [1, weights bytes]."""
    rows = report["sweep"]["rows"]
    rec = [(t, r["recovery_s_median"]) for r in rows if (t := _recovery_terms(r)) is not None]
    st = [([1.0, r["weights_nbytes"]], r["stall_per_publish_s"]) for r in rows
          if r["strategy"] in ("behav", "loglinear", "linear", "recompute", "ewma") and r["stall_per_publish_s"]]
    if len(rec) < 3 or len(st) < 2:
        raise ValueError("the sweep report needs at least 3 rows of recompute/ewma/snapshot and 2 rows of "
                         "behav/loglinear/linear/recompute/ewma with publishes to fit the CPU constants")
    call, inv_f, inv_copy = nonneg_lstsq([t for t, _ in rec], [y for _, y in rec])
    floor, inv_pub = nonneg_lstsq([x for x, _ in st], [y for _, y in st])
    return CpuConstants(call, 1 / inv_f if inv_f > 0 else math.inf, 1 / inv_copy if inv_copy > 0 else math.inf,
                        floor, 1 / inv_pub if inv_pub > 0 else math.inf)


def predict_cpu(row: dict[str, Any], c: CpuConstants) -> dict[str, float]:
    """Predicted recovery seconds, publish stall and extra bytes held of one sweep row."""
    terms = _recovery_terms(row)
    recovery = 0.0 if terms is None else (terms[0] * c.forward_call_s + terms[1] / c.flops_per_s
                                          + terms[2] / c.copy_bytes_per_s)
    stall = c.stall_floor_s + row["weights_nbytes"] / c.publish_bytes_per_s + _hook_copy_bytes(row) / c.copy_bytes_per_s
    if row["strategy"] == "dedicated":
        stall += row["weights_nbytes"] / c.publish_bytes_per_s  # its own checkpoint, written inside the publish
    p32 = row["params"] * FP32
    # snapshot keeps every version that a trajectory the gate admitted may still reference: eta + 1 of them,
    # and no more than the run published (a sweep run of n steps publishes versions 0..n-1). The versions one
    # batch spans (distinct_versions_max) undercount it: measured 6 sets held at eta 8 in 6 steps, 2 per batch
    held = {"snapshot": min(row["eta"] + 1, row.get("n_steps", row["eta"] + 1)) * p32, "ewma": p32,
            "interrupt_sync": p32,
            "dedicated": row["weights_nbytes"]}.get(row["strategy"], 0.0)
    return {"recovery_s_median": recovery, "stall_per_publish_s": stall, "extra_bytes_held": held}


#: measured values below these are timer and scheduling noise: no ratio is taken
NOISE = {"recovery_s_median": 0.002, "stall_per_publish_s": 0.002, "extra_bytes_held": 1.0}


def compare_cpu(report: dict[str, Any], c: CpuConstants, tolerance: float = 0.25) -> dict[str, Any]:
    """Predicted against measured for every row and quantity; ``within`` counts the ratios within
    ``tolerance`` of 1 among the compared (measured and predicted above :data:`NOISE`)."""
    out, compared, within = [], 0, 0
    for row in report["sweep"]["rows"]:
        pred = predict_cpu(row, c)
        for key, p in pred.items():
            m = row[key]
            if m is None:
                continue
            ratio = p / m if m > NOISE[key] and p > NOISE[key] else None
            if ratio is not None:
                compared += 1
                within += abs(ratio - 1) <= tolerance
            out.append({"model": row["model"], "eta": row["eta"], "strategy": row["strategy"], "quantity": key,
                        "measured": m, "predicted": p, "ratio": ratio})
    return {"rows": out, "compared": compared, "within": within, "tolerance": tolerance}


def render_calibration(c: CpuConstants, cmp: dict[str, Any]) -> str:
    lines = ["CPU constants fitted on the sweep:",
             *(f"  {k} = {v:.4g}" for k, v in asdict(c).items()), "",
             "| model | eta | strategy | quantity | measured | predicted | predicted / measured |",
             "|---|---|---|---|---|---|---|"]
    for r in cmp["rows"]:
        ratio = "n/a (below noise)" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['model']} | {r['eta']} | {r['strategy']} | {r['quantity']} | {r['measured']:.4g} | "
                     f"{r['predicted']:.4g} | {ratio} |")
    lines += ["", f"{cmp['within']} of {cmp['compared']} compared values within {cmp['tolerance']:.0%} "
                  "(values below the noise floor are not compared)."]
    return "\n".join(lines)
