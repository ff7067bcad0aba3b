"""Dashboard names of megarl's metrics: one namespace per part of the loop, as the anchors' dashboards group them.

``metrics.jsonl`` keeps each step's flat keys (``reward_mean``, ``pg_loss``, ...: the file megarl's own tools
read, megarl/bench); TensorBoard and Weights & Biases get them under a namespace:

- ``actor/``: the policy update (loss terms, ratios and clipping, entropy, gradient norm, learning rate,
  skipped steps);
- ``rollout/``: what the engines produced and how (rewards, lengths, staleness, splices and interrupts,
  engine restarts, reward-service failures, weight-sync bytes);
- ``timing/``: seconds (every key ending in ``_s``);
- ``recovery/``: the old-logit anchor and the train-inference correction (the anchor's distance from
  logp_behav, r_d, the behaviour weight's mask and down-weighting, the strategy's own counters, MoE routes);
- ``eval/``: held-out evaluation (megarl/loop/evaluation.py).

:data:`VERL_EQUIVALENTS` lists verl's names for the same quantities (its ``actor/``, ``critic/score``,
``response_length/`` and ``timing_s/`` groups), which docs/guide.md prints as a table.
"""
from __future__ import annotations

NAMESPACES = ("actor", "rollout", "timing", "recovery", "eval")

#: flat key prefixes (before the first "/") that belong to recovery/
_RECOVERY_GROUPS = ("behav_w", "r_d", "ewma", "verify", "routes", "snapshot", "dedicated", "interrupt_sync")
_RECOVERY = {"abs_logp_anchor_minus_behav_mean", "anchor_exact", "behav_w_mean", "abs_logp_prox_minus_old_mean"}
_ACTOR = {"loss", "pg_loss", "approx_kl", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "entropy",
          "entropy_coef", "entropy_loss", "kl_ref", "kl_loss", "grad_norm", "lr", "ratio_mean", "active_frac",
          "normalizer", "n_valid", "skipped", "skipped_nonfinite_grad_norm", "skipped_nonfinite_loss",
          "consecutive_skips", "n_nonfinite_logp_theta", "n_nonfinite_logratio", "n_nonfinite_ratio", "version"}
_ROLLOUT_PREFIXES = ("n_engine", "n_reward", "staleness_", "response_len", "n_agent", "n_tool",
                     "weight_sync_bytes", "weight_sync_groups", "weight_sync_fallbacks")
_ROLLOUT = {"reward_mean", "reward_std", "n_spliced", "n_interrupted", "n_splice_holds", "n_dropped", "n_filtered",
            "n_kept", "n_seqs", "n_routes_missing", "n_publish_inflight", "tokens", "version_lag_hist",
            "n_engines_live", "n_continued_after_resume", "n_regenerated_after_resume",
            "n_tokens_regenerated_after_resume"}

#: megarl's dashboard name -> verl's name for the same quantity (where verl logs one)
VERL_EQUIVALENTS = {
    "actor/pg_loss": "actor/pg_loss",
    "actor/clip_frac_high": "actor/pg_clipfrac",
    "actor/clip_frac_low": "actor/pg_clipfrac_lower",
    "actor/approx_kl": "actor/ppo_kl",
    "actor/entropy": "actor/entropy",
    "actor/grad_norm": "actor/grad_norm",
    "actor/lr": "actor/lr",
    "rollout/reward_mean": "critic/score/mean",
    "rollout/response_len_mean": "response_length/mean",
    "rollout/response_len_max": "response_length/max",
    "timing/step_s": "timing_s/step",
    "timing/train_step_s": "timing_s/update_actor",
    "timing/recovery_s": "timing_s/old_log_prob",
}


def dashboard_name(key: str) -> str:
    """The namespaced name of the flat metrics.jsonl key ``key`` (module doc); unknown keys go to ``other/``."""
    head = key.split("/", 1)[0]
    if "/" in key and head in NAMESPACES:
        return key
    if "/" in key and head in _RECOVERY_GROUPS or key in _RECOVERY:
        return f"recovery/{key}"
    if key.endswith("_s"):
        return f"timing/{key}"
    if key in _ACTOR:
        return f"actor/{key}"
    if key in _ROLLOUT or key.startswith(_ROLLOUT_PREFIXES):
        return f"rollout/{key}"
    return f"other/{key}"
