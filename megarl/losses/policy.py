"""The one policy-gradient loss used by every old-logit recovery strategy (docs/design.md §3).

Per token t of a [B, T] batch, with ``logp_anchor`` = ``logp_old`` for an exact
recovery strategy or ``logp_prox`` for an approximate one, and A_t the advantage:

    w_t    = exp(logp_anchor_t - logp_behav_t)           train-inference weight (detached)
    M_t    = 1[behav_low <= w_t <= behav_high]           behaviour mask (mis, mask only)
    r_t    = exp(logp_theta_t - logp_anchor_t)           trust-region ratio (grad flows here)
    pg_t   = max(-r_t * A_t, -clip(r_t, 1 - eps_clip, 1 + eps_clip_high) * A_t)
    pg_t   = min(pg_t, -c * A_t)   if A_t < 0 and dual_clip = c   (Ye et al. 2020)
    l_t    = M_t * f(w_t) * pg_t
    f(w)   = w (mis) | clamp(w, behav_low or 0, behav_high) (tis) | 1 (mask, none)

With ``behav_level="sequence"`` w of a sequence is the geometric mean
exp(mean of log w_t over its valid tokens); it replaces w_t for all tokens of the
sequence and the bounds are tested once per sequence.

The scalar loss reduces l by ``cfg.agg``, with token counts "all" (valid tokens,
loss_mask = 1) or "kept" (valid tokens with M_t = 1) by ``cfg.denominator``:

    token-mean            sum_t l_t / N_tok
    seq-mean-token-mean   sum_s (sum_{t in s} l_t / n_s) / N_seq
    seq-mean-token-sum    sum_s (sum_{t in s} l_t) / N_seq

N_tok = number of counted tokens; n_s = counted tokens of sequence s; N_seq =
number of sequences with n_s > 0 (a sequence without counted tokens contributes 0
and is not counted). ``normalizer``, when given, replaces N_tok (token-mean) or
N_seq (seq-mean-*) so that micro-batch losses sum to the full-batch loss; it is
the sum over micro-batches of :func:`loss_normalizer`. n_s never needs a global
value because a sequence never spans micro-batches.

Special cases, reproduced exactly:
- PPO (Schulman et al. 2017): logp_anchor = logp_behav, behav_weight="none".
- AReaL decoupled PPO (Fu et al. 2025, arXiv 2505.24298): logp_anchor = logp_prox,
  behav_weight="mis", behav_low=None, behav_high=cap, agg="token-mean",
  denominator="all" (tokens above the cap are dropped but still counted).
- IcePop: behav_weight="mis", behav_low=0.5, behav_high=5.
- TIS (truncated importance sampling): behav_weight="tis", behav_high=C.

Non-finite values. Masked positions (loss_mask = 0) may hold anything (-inf, NaN
padding): they are replaced by 0 with torch.where before any arithmetic, so no
NaN reaches the loss or the gradient. At valid positions the precedence is:
1. advantages must be finite, else ValueError (naming the count); a non-finite
   logp_theta (a forward that overflowed) makes the loss NaN, so that the trainer
   skips the step as it skips any non-finite loss; the other metrics are those of
   the finite tokens and ``n_nonfinite_logp_theta`` counts the bad ones;
2. logp_anchor / logp_behav may be non-finite: every log-ratio they enter that is
   not finite is treated as 0 (w_t = 1, and r_t = 1 with no gradient), counted in
   the metrics ``n_nonfinite_logratio`` (w) and ``n_nonfinite_ratio`` (r);
3. finite log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] against
   exp overflow (only absurd ratios, beyond e^20 ~ 4.9e8, are affected);
4. a non-finite loss after all this with a finite logp_theta raises ValueError;
   never a silent NaN.

All arithmetic is in float32 whatever the input dtype.
"""
from __future__ import annotations

import math

import torch

from megarl.losses.config import PolicyLossConfig

LOG_RATIO_CLAMP = 20.0
"""Overflow guard on log w and log r (see the module docstring, rule 3)."""

_CHOICES = {
    "behav_weight": ("none", "mis", "tis", "mask"),
    "behav_level": ("token", "sequence"),
    "agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "denominator": ("all", "kept"),
}


def _check_config(cfg: PolicyLossConfig) -> None:
    for name, valid_values in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in valid_values:
            raise ValueError(f"PolicyLossConfig.{name}={value!r} is not one of {list(valid_values)}")
    for name in ("eps_clip", "eps_clip_high", "behav_low", "behav_high"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"PolicyLossConfig.{name}={value!r} must be a finite number >= 0")
    if cfg.eps_clip is None:
        raise ValueError("PolicyLossConfig.eps_clip must be a number, not None")
    if cfg.behav_low is not None and cfg.behav_high is not None and cfg.behav_low > cfg.behav_high:
        raise ValueError(f"PolicyLossConfig.behav_low={cfg.behav_low} > behav_high={cfg.behav_high}")
    if cfg.dual_clip is not None and not (math.isfinite(cfg.dual_clip) and cfg.dual_clip > 1):
        raise ValueError(f"PolicyLossConfig.dual_clip={cfg.dual_clip!r} must be None or a number c > 1 "
                         "(the loss of A<0 tokens is capped at c*|A|; c <= 1 would cap below the unclipped PPO loss)")


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"policy_loss expects tensors of one shape [B, T]; got {shapes}")


def _zero_masked(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # torch.where, not x * mask: padding may be -inf or NaN and 0 * inf = NaN.
    return torch.where(valid, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))


def _require_finite(name: str, x: torch.Tensor) -> None:
    # Called after _zero_masked, so any non-finite value sits at a valid position.
    n_bad = int((~torch.isfinite(x)).sum())
    if n_bad:
        raise ValueError(f"{name} has {n_bad} non-finite values at valid positions (loss_mask=1); "
                         f"only masked positions may hold -inf/NaN")


def _behav_weight_and_mask(logp_anchor, logp_behav, valid, cfg):
    """Returns (w, f(w), keep, n_nonfinite_logratio, |log w_tok|); inputs already zeroed at masked positions."""
    log_w = logp_anchor - logp_behav
    finite = torch.isfinite(log_w)
    n_nonfinite = (~finite & valid).sum()
    log_w = torch.where(finite, log_w, torch.zeros_like(log_w))  # unknown discrepancy -> w = 1
    abs_log_w_tok = log_w.abs()
    if cfg.behav_level == "sequence":
        # geometric mean of w over the valid tokens of each sequence, shared by all of them
        n_valid_seq = valid.sum(-1, keepdim=True).clamp(min=1)
        log_w = (log_w.sum(-1, keepdim=True) / n_valid_seq).expand_as(log_w)
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    in_bounds = torch.ones_like(valid)
    if cfg.behav_weight in ("mis", "mask"):
        if cfg.behav_low is not None:
            in_bounds = in_bounds & (w >= cfg.behav_low)
        if cfg.behav_high is not None:
            in_bounds = in_bounds & (w <= cfg.behav_high)
    keep = valid & in_bounds

    if cfg.behav_weight == "mis":
        weight = w
    elif cfg.behav_weight == "tis":
        weight = w.clamp(min=cfg.behav_low or 0.0, max=cfg.behav_high)
    else:  # none, mask
        weight = torch.ones_like(w)
    return w, weight, keep, n_nonfinite, abs_log_w_tok


def _counts(valid: torch.Tensor, keep: torch.Tensor, cfg: PolicyLossConfig):
    """(counted tokens per sequence [B], local normalizer) for cfg.agg / cfg.denominator."""
    counted = keep if cfg.denominator == "kept" else valid
    n_tok_seq = counted.sum(-1)
    if cfg.agg == "token-mean":
        return n_tok_seq, n_tok_seq.sum()
    return n_tok_seq, (n_tok_seq > 0).sum()


def normalizer_needs_anchor(cfg: PolicyLossConfig) -> bool:
    """True when :func:`loss_normalizer` depends on the anchor: only "kept" counts under a behaviour mask
    with a bound (mis or mask); otherwise every valid token is kept and counted whatever the anchor."""
    return (cfg.denominator == "kept" and cfg.behav_weight in ("mis", "mask")
            and (cfg.behav_low is not None or cfg.behav_high is not None))


def loss_normalizer(logp_anchor: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor,
                    cfg: PolicyLossConfig) -> float:
    """The local count policy_loss divides by when ``normalizer`` is None.

    token-mean: valid tokens ("all") or kept tokens ("kept"); seq-mean-*: sequences
    with at least one valid ("all") or kept ("kept") token. Counts add up, so the
    global normalizer of a split batch is the sum of this over its micro-batches
    (and over data-parallel ranks if the loss should be a global mean).
    """
    _check_config(cfg)
    _check_shapes(logp_anchor=logp_anchor, logp_behav=logp_behav, loss_mask=loss_mask)
    valid = loss_mask != 0
    _, _, keep, _, _ = _behav_weight_and_mask(
        _zero_masked(logp_anchor.detach(), valid), _zero_masked(logp_behav.detach(), valid), valid, cfg)
    return float(_counts(valid, keep, cfg)[1])


def policy_loss(logp_theta: torch.Tensor, logp_anchor: torch.Tensor, logp_behav: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor, cfg: PolicyLossConfig, *,
                normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss (grad through logp_theta only) and a dict of float metrics; see the module docstring.

    normalizer: None = divide by the local count (:func:`loss_normalizer`); otherwise
    the global count over the whole batch: valid tokens (token-mean, "all"), kept
    tokens (token-mean, "kept"), or sequences with >= 1 valid / kept token
    (seq-mean-token-mean and seq-mean-token-sum, "all" / "kept"). A normalizer
    <= 0 (empty global batch) is treated as 1.
    """
    _check_config(cfg)
    _check_shapes(logp_theta=logp_theta, logp_anchor=logp_anchor, logp_behav=logp_behav,
                  advantages=advantages, loss_mask=loss_mask)
    if normalizer is not None and not math.isfinite(normalizer):
        raise ValueError(f"normalizer={normalizer!r} must be finite")

    valid = loss_mask != 0
    logp_theta = _zero_masked(logp_theta, valid)
    logp_anchor = _zero_masked(logp_anchor.detach(), valid)
    logp_behav = _zero_masked(logp_behav.detach(), valid)
    advantages = _zero_masked(advantages.detach(), valid)
    _require_finite("advantages", advantages)
    # the forward's own log-probs: non-finite ones make the step skip (NaN loss), never raise; the rest of the
    # arithmetic sees 0 there so that every metric stays that of the finite tokens
    theta_bad = ~torch.isfinite(logp_theta)
    n_nonfinite_theta = theta_bad.sum()
    logp_theta = torch.where(theta_bad, torch.zeros_like(logp_theta), logp_theta)

    # Train-inference correction: which tokens count (M) and with which weight f(w).
    w, weight, keep, n_nonfinite_logratio, abs_log_w_tok = _behav_weight_and_mask(
        logp_anchor, logp_behav, valid, cfg)

    # Trust-region ratio against the anchor. A non-finite anchor leaves r = 1 with no
    # gradient (torch.where sends zero gradient to the unselected branch).
    log_ratio = logp_theta - logp_anchor
    ratio_ok = torch.isfinite(log_ratio)
    n_nonfinite_ratio = (~ratio_ok & valid).sum()
    ratio_ok = ratio_ok & ~theta_bad  # a token without a finite logp_theta counts as r = 1 in the metrics
    log_ratio = torch.where(ratio_ok, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    eps_low = cfg.eps_clip
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    pg_loss = torch.maximum(-ratio * advantages, -clipped_ratio * advantages)
    dual_active = torch.zeros_like(valid)
    if cfg.dual_clip is not None:
        # For A < 0 the PPO loss grows without bound in r; cap it at c*|A| = -c*A.
        dual_cap = -cfg.dual_clip * advantages
        dual_active = valid & (advantages < 0) & (pg_loss > dual_cap)
        pg_loss = torch.where(advantages < 0, torch.minimum(pg_loss, dual_cap), pg_loss)

    per_token = torch.where(keep, weight * pg_loss, torch.zeros_like(pg_loss))

    n_tok_seq, local_normalizer = _counts(valid, keep, cfg)
    if cfg.agg == "token-mean":
        numerator = per_token.sum()
    else:
        seq_loss = per_token.sum(-1)
        if cfg.agg == "seq-mean-token-mean":
            seq_loss = seq_loss / n_tok_seq.clamp(min=1)
        numerator = seq_loss.sum()
    denom = local_normalizer.float() if normalizer is None else torch.tensor(float(normalizer), device=valid.device)
    loss = numerator / torch.where(denom > 0, denom, torch.ones_like(denom))

    with torch.no_grad():
        n_valid = valid.sum()
        per_valid = n_valid.clamp(min=1).float()

        def valid_mean(x):
            return torch.where(valid, x.float(), torch.zeros_like(x, dtype=torch.float32)).sum() / per_valid

        stats = {
            "pg_loss": loss.detach(),
            "n_valid": n_valid,
            "n_kept": keep.sum(),
            # 1.0 when there is nothing valid: no token was rejected (keeps EWMA auto-reset quiet)
            "active_frac": torch.where(n_valid > 0, keep.sum() / per_valid, torch.ones_like(per_valid)),
            "n_seqs": (n_tok_seq > 0).sum(),
            "normalizer": denom,
            # fractions of valid tokens on which a clip is active (gradient stopped or capped)
            "clip_frac_low": valid_mean((ratio < 1 - eps_low) & (advantages < 0)),
            "clip_frac_high": valid_mean((ratio > 1 + eps_high) & (advantages > 0)),
            "dual_clip_frac": valid_mean(dual_active),
            "behav_w_mean": valid_mean(w),
            "abs_logp_anchor_minus_behav_mean": valid_mean(abs_log_w_tok),
            # k2 estimator of KL(anchor || theta): mean of 0.5 * (logp_theta - logp_anchor)^2
            "approx_kl": valid_mean(0.5 * log_ratio.detach() ** 2),
            "ratio_mean": valid_mean(ratio.detach()),
            "n_nonfinite_logratio": n_nonfinite_logratio,
            "n_nonfinite_ratio": n_nonfinite_ratio,
            "n_nonfinite_logp_theta": n_nonfinite_theta,
        }
        values = torch.stack([v.float().reshape(()) for v in stats.values()]).tolist()  # one device sync
    metrics = dict(zip(stats.keys(), values))
    if metrics["n_nonfinite_logp_theta"]:
        metrics["pg_loss"] = math.nan
        return loss * math.nan, metrics  # still in the graph: the trainer's backward runs, then it skips
    if not math.isfinite(metrics["pg_loss"]):
        raise ValueError(f"policy loss is {metrics['pg_loss']} despite finite inputs (overflowing advantages?); "
                         f"metrics: {metrics}")
    return loss, metrics
