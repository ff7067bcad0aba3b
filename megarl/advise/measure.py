"""What `megarl advise` measures on each train batch, and the summary of a whole calibration run.

Per batch, over the policy tokens (loss_mask = 1 and a sampling version), with
``truth`` the exact ``logp_old`` (verify-recovery's reference, a forward of
every token's own version) and ``logp_theta`` the trainer's log-probs at the
start of the step:

- the train-inference gap |truth - logp_behav| per token, and its sum per
  sequence by response length (policy tokens of the sequence);
- what the configured train-inference rule does under the exact anchor: the
  shares it masks and down-weights, from megarl/losses/mismatch.py
  (``behav_weight_stats``, the loss's own w, M and f);
- staleness: the lag ``batch.version - v_t`` of every token, spliced
  sequences and versions per sequence;
- per anchor (each approximate strategy's, and behav's): |anchor - truth|
  and the share of tokens whose PPO clip decision differs from the exact
  anchor's. A token is clipped when the loss sends it no gradient: the
  gradient of :func:`megarl.losses.policy.policy_loss` (the config's clip
  widths and dual clip, train-inference weight off so that only the trust
  region decides) with respect to logp_theta is zero at a token whose
  advantage is not. That is the loss's own formula, not a copy of it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from megarl.losses.mismatch import behav_weight_stats
from megarl.losses.policy import policy_loss
from megarl.types import NO_VERSION, TrainBatch

#: upper edges of the response-length bins of the per-sequence gap (policy tokens per sequence); the last is open
LENGTH_BINS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def policy_tokens(batch: TrainBatch) -> torch.Tensor:
    """[B, L-1] bool: tokens the loss trains that a policy version sampled."""
    return ((batch.loss_mask != 0) & (batch.versions != NO_VERSION)).cpu()


def clipped(logp_theta: torch.Tensor, anchor: torch.Tensor, batch: TrainBatch, loss_cfg: Any) -> torch.Tensor:
    """[B, L-1] bool: policy tokens with a non-zero advantage whose PPO loss under ``anchor`` passes no gradient
    to logp_theta (the clip, or the dual clip, is active); see the module docstring."""
    cfg = dataclasses.replace(loss_cfg, behav_weight="none", denominator="all", agg="token-mean")
    theta = logp_theta.detach().float().cpu().clone().requires_grad_(True)
    mask = policy_tokens(batch)
    adv = batch.advantages.detach().float().cpu()
    behav = batch.logp_behav.detach().float().cpu()
    with torch.enable_grad():  # the probe runs under no_grad; this gradient is the measurement
        loss, _ = policy_loss(theta, anchor.detach().float().cpu(), behav, adv, mask.float(), cfg)
        (grad,) = torch.autograd.grad(loss, theta)
    return mask & (adv != 0) & (grad == 0)


def _finite_abs(x: torch.Tensor) -> np.ndarray:
    x = x.abs().numpy().astype(np.float64)
    return np.where(np.isfinite(x), x, math.inf)


def distribution(values: np.ndarray) -> dict[str, float]:
    """mean, p50, p99, max and count of ``values`` (zeros when empty)."""
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)), "max": float(values.max()), "n": int(values.size)}


#: decades of the gap histogram: [0, 1e-8), [1e-8, 1e-7), ..., [1e0, inf)
GAP_DECADES = tuple(range(-8, 1))


def decade_hist(values: np.ndarray) -> dict[str, int]:
    """Counts of ``values`` per decade of :data:`GAP_DECADES` (labels '<1e-08', '1e-08', ..., '>=1e+00')."""
    edges = [10.0 ** d for d in GAP_DECADES]
    counts = np.histogram(values, bins=[-np.inf, *edges, np.inf])[0] if values.size else np.zeros(len(edges) + 1)
    labels = [f"<{edges[0]:.0e}", *(f"{e:.0e}" for e in edges[:-1]), f">={edges[-1]:.0e}"]
    return {label: int(c) for label, c in zip(labels, counts)}


def length_bin(n: int) -> str:
    """The response-length bin of a sequence of ``n`` policy tokens, e.g. '5-8'."""
    low = 1
    for edge in LENGTH_BINS:
        if n <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{LENGTH_BINS[-1]}"


class Accumulator:
    """Collects every batch's measurements (:meth:`add`) and summarizes the run (:meth:`summary`)."""

    def __init__(self, loss_cfg: Any) -> None:
        self.loss_cfg = loss_cfg
        self.gaps: list[np.ndarray] = []
        self.seq_gap: dict[str, list[float]] = {}
        self.lags: dict[int, int] = {}
        self.versions_per_seq: dict[int, int] = {}
        self.n_sequences = self.n_spliced = 0
        self.rule = {"n_tokens": 0.0, "masked": 0.0, "downweighted": 0.0}
        self.anchor_err: dict[str, list[np.ndarray]] = {}
        self.clip_differs: dict[str, list[float]] = {}  # name -> [tokens clipped differently, policy tokens]
        self.exact_clipped = [0.0, 0.0]
        self.n_batches = 0

    def add(self, batch: TrainBatch, truth: torch.Tensor, logp_theta: torch.Tensor,
            anchors: dict[str, torch.Tensor]) -> None:
        """One train batch: ``truth`` the exact logp_old, ``anchors`` name -> anchor tensor [B, L-1]."""
        mask = policy_tokens(batch)
        behav = batch.logp_behav.detach().float().cpu()
        truth = truth.float().cpu()
        gap = (truth - behav).abs()
        self.gaps.append(_finite_abs(gap[mask]))
        versions = batch.versions.cpu()
        for b in range(batch.size):
            row = mask[b]
            n = int(row.sum())
            if n == 0:
                continue
            self.seq_gap.setdefault(length_bin(n), []).append(float(_finite_abs(gap[b][row]).sum()))
            k = len(torch.unique(versions[b][row]))
            self.versions_per_seq[k] = self.versions_per_seq.get(k, 0) + 1
            self.n_sequences += 1
            self.n_spliced += k >= 2
        for lag, count in zip(*np.unique((batch.version - versions[mask]).numpy(), return_counts=True)):
            self.lags[int(lag)] = self.lags.get(int(lag), 0) + int(count)
        stats = behav_weight_stats(truth, behav, mask.float(), self.loss_cfg)
        n = float(mask.sum())
        if stats:
            self.rule["n_tokens"] += n
            self.rule["masked"] += stats["behav_w/masked_frac"] * n
            self.rule["downweighted"] += stats["behav_w/downweighted_frac"] * n
        exact_clip = clipped(logp_theta, truth, batch, self.loss_cfg)
        self.exact_clipped[0] += float(exact_clip.sum())
        self.exact_clipped[1] += n
        for name, anchor in anchors.items():
            anchor = anchor.detach().float().cpu()
            self.anchor_err.setdefault(name, []).append(_finite_abs((anchor - truth)[mask]))
            differs = clipped(logp_theta, anchor, batch, self.loss_cfg) != exact_clip
            acc = self.clip_differs.setdefault(name, [0.0, 0.0])
            acc[0] += float(differs.sum())
            acc[1] += n
        self.n_batches += 1

    def summary(self) -> dict[str, Any]:
        """Every measurement of the run, JSON-ready."""
        gaps = np.concatenate(self.gaps) if self.gaps else np.zeros(0)
        n_lag = sum(self.lags.values())
        n_rule = max(self.rule["n_tokens"], 1.0)
        return {
            "n_batches": self.n_batches,
            "gap": {**distribution(gaps), "hist": decade_hist(gaps),
                    "seq_sum_by_length": {k: {"n_sequences": len(v), "mean": float(np.mean(v)),
                                              "max": float(np.max(v))}
                                          for k, v in sorted(self.seq_gap.items(), key=lambda kv: _bin_key(kv[0]))}},
            "rule": {"masked_frac": self.rule["masked"] / n_rule,
                     "downweighted_frac": self.rule["downweighted"] / n_rule, "n_tokens": self.rule["n_tokens"]},
            "staleness": {"lag_hist": {str(k): v for k, v in sorted(self.lags.items())},
                          "lag_mean": sum(k * v for k, v in self.lags.items()) / max(n_lag, 1),
                          "lag_max": max(self.lags, default=0),
                          "stale_frac": sum(v for k, v in self.lags.items() if k >= 1) / max(n_lag, 1),
                          "spliced_frac": self.n_spliced / max(self.n_sequences, 1),
                          "versions_per_sequence": {str(k): v for k, v in sorted(self.versions_per_seq.items())},
                          "n_sequences": self.n_sequences},
            "exact_clipped_frac": self.exact_clipped[0] / max(self.exact_clipped[1], 1.0),
            "anchors": {name: {**distribution(np.concatenate(errs)),
                               "clip_differs_frac": self.clip_differs[name][0] / max(self.clip_differs[name][1], 1.0)}
                        for name, errs in self.anchor_err.items()},
        }


def _bin_key(label: str) -> int:
    return int(label.lstrip(">").split("-")[0])
