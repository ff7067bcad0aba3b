"""The per-step objective the trainer minimizes: the policy loss (megarl/losses/policy.py) plus,
optionally, a reference-KL penalty; built once per batch by the controller.

The anchor is checked before the step. An exact strategy (``AnchorResult.exact``)
promises the true ``logp_old`` at every policy token: a missing or non-finite
value there is a defect of the strategy, and training around it (the loss
treats a non-finite log-ratio as 0: weight 1, ratio 1, no gradient) would
silently drop the token, so it raises :class:`TrainingError` naming the
strategy, the trajectory and the version. Approximate anchors keep that
neutralization; the loss counts it (``n_nonfinite_ratio``).
"""
from __future__ import annotations

import torch

from megarl.errors import TrainingError
from megarl.losses.entropy_control import EntropyControl
from megarl.losses.policy import loss_normalizer, normalizer_needs_anchor, policy_loss


def _who(strategy: str) -> str:
    return f"recovery strategy {strategy!r}" if strategy else "the recovery strategy"


def check_exact_anchor(logp_anchor, batch, strategy: str) -> None:
    """Raise TrainingError unless ``logp_anchor`` is finite at every policy token (loss_mask 1) of ``batch``."""
    who = _who(strategy)
    if logp_anchor is None:
        raise TrainingError(f"{who} claims an exact logp_old but returned no anchor for the batch of trainer "
                            f"version {batch.version} (trajectories {', '.join(batch.traj_ids[:4])}...): an exact "
                            f"strategy must return logp_old for every policy token")
    bad = (batch.loss_mask != 0) & ~torch.isfinite(logp_anchor.to(batch.loss_mask.device))
    if not bool(bad.any()):
        return
    rows, cols = bad.nonzero(as_tuple=True)
    b, t = int(rows[0]), int(cols[0])
    where = f"position {t}"
    if batch.prompt_lens is not None:
        where = f"response index {t - int(batch.prompt_lens[b]) + 1}"
    raise TrainingError(
        f"{who} claims an exact logp_old but its anchor is missing or non-finite at {int(bad.sum())} policy "
        f"token(s) of the batch of trainer version {batch.version}; the first: trajectory {batch.traj_ids[b]!r}, "
        f"{where}, sampled by version {int(batch.versions[b, t])} (value {float(logp_anchor[b, t])}). Training "
        f"would drop these tokens silently; the strategy lost or never scored them (a bug to report with this "
        f"message), or use an approximate strategy")


def loss_fn_factory(loss_cfg, kl_coef: float = 0.0, ref_logprobs=None, strategy: str = ""):
    """``factory(batch, anchor) -> loss_fn`` for the trainer: the policy loss, plus the reference KL.

    ``ref_logprobs(batch) -> [B, L-1]`` scores the batch with the reference
    policy (needed when ``kl_coef > 0``); the penalty is the k3 estimator
    exp(ref - theta) - (ref - theta) - 1 (Schulman, "Approximating KL
    divergence", 2020), averaged over all policy tokens of the batch.
    ``strategy`` names the recovery strategy in errors about its anchor.

    The factory's ``entropy_control`` holds the entropy bonus's coefficient (fixed, or adapted after each step:
    megarl/losses/entropy_control.py); ``factory(batch, anchor, entropy_coef=c)`` uses ``c`` instead (the other
    trainer ranks use the value rank 0 used). A loss function's ``entropy_coef`` is the coefficient it applies.
    """
    control = EntropyControl.from_config(loss_cfg)

    def factory(batch, anchor, entropy_coef: float | None = None):
        coef = control.coef if entropy_coef is None else float(entropy_coef)
        if anchor.exact and anchor.from_theta is None:
            check_exact_anchor(anchor.logp_anchor, batch, strategy)
        if batch.logp_anchor is not None:
            ref = batch.logp_anchor
        elif anchor.from_theta is None or not normalizer_needs_anchor(loss_cfg):
            # the count does not depend on the anchor (every valid token is kept): logp_behav gives it exactly
            ref = batch.logp_behav
        else:
            # the micro-batch losses are divided by the batch's count before the first backward, and a
            # from_theta anchor exists only inside each micro-batch: the strategy must give it before the step
            raise TrainingError(
                f"loss.denominator=kept with loss.behav_weight={loss_cfg.behav_weight} counts the tokens the "
                f"anchor keeps, but {_who(strategy)} gave its anchor only per micro-batch "
                f"(from_theta); it must return the anchor tensor when the loss needs it "
                f"(megarl.losses.normalizer_needs_anchor), or set loss.denominator=all")
        # the global denominator, so that micro-batch losses add up to the full-batch loss
        normalizer = loss_normalizer(ref, batch.logp_behav, batch.loss_mask, loss_cfg)
        if kl_coef > 0:
            batch_ref = ref_logprobs(batch)
            rows = {tid: i for i, tid in enumerate(batch.traj_ids)}
            n_valid = max(float(batch.loss_mask.sum()), 1.0)

        def loss_fn(logp_theta, mb, _counts=None, entropy=None):
            if anchor.from_theta is not None:
                logp_anchor = anchor.from_theta(logp_theta.detach(), mb)
                if anchor.exact:
                    check_exact_anchor(logp_anchor, mb, strategy)
            else:
                logp_anchor = mb.logp_anchor
            loss, metrics = policy_loss(logp_theta, logp_anchor, mb.logp_behav, mb.advantages, mb.loss_mask,
                                        loss_cfg, normalizer=normalizer)
            if kl_coef > 0:
                idx = [rows[t] for t in mb.traj_ids]
                logp_ref = batch_ref[idx, : logp_theta.shape[1]].to(logp_theta.device)
                mask = mb.loss_mask.to(logp_theta.device) > 0
                diff = torch.where(mask, logp_ref - logp_theta, torch.zeros_like(logp_theta))
                kl = (torch.exp(diff) - diff - 1.0).sum() / n_valid
                loss = loss + kl_coef * kl
                metrics = {**metrics, "kl_ref": float(kl.detach()) * n_valid / max(float(mask.sum()), 1.0)}
            if loss_fn.wants_entropy:
                loss, metrics = _entropy_bonus(loss, metrics, entropy, mb, _counts, coef)
            return loss, metrics

        # the trainer then passes entropy= (with a target, also while the coefficient is 0: it is observed)
        loss_fn.wants_entropy = coef > 0 or control.adaptive
        loss_fn.entropy_coef = coef
        return loss_fn

    factory.entropy_control = control
    return factory


def _entropy_bonus(loss, metrics, entropy, mb, counts, coef: float):
    """``loss - coef * sum(entropy over mb's policy tokens) / the batch's policy-token count`` (so the
    micro-batch terms add up to coef x the batch's mean entropy), and the micro-batch's mean entropy."""
    if entropy is None or counts is None:
        raise TrainingError("an entropy bonus (loss.entropy_coef > 0 or loss.entropy_target) needs the policy's "
                            "entropy, but the trainer passed none: it must honour the loss function's "
                            "wants_entropy (megarl/models/entropy.py)")
    mask = mb.loss_mask.to(entropy.device)[:, : entropy.shape[1]] > 0
    total = torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
    if coef > 0:  # at 0 (an adaptive coefficient at its floor) the entropy is only observed
        loss = loss - coef * total / max(counts["n_valid_tokens"], 1.0)
    return loss, {**metrics, "entropy": float(total.detach()) / max(float(mask.sum()), 1.0)}


def loss_fn_factory_for_run(cfg, trainer):
    """The loss factory; with a reference KL, the reference is the initial weights of this trainer."""
    if cfg.advantage.kl_coef <= 0:
        return loss_fn_factory(cfg.loss, strategy=cfg.recovery.name)
    ref_params = trainer.get_params()

    def ref_logprobs(batch):
        with trainer.use_params(ref_params):
            return trainer.logprobs(batch)

    return loss_fn_factory(cfg.loss, cfg.advantage.kl_coef, ref_logprobs, strategy=cfg.recovery.name)
