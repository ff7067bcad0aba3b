"""The per-step objective the trainer minimizes: the policy loss (megarl/losses/policy.py) plus,
optionally, a reference-KL penalty; built once per batch by the controller."""
from __future__ import annotations

import torch

from megarl.losses.policy import loss_normalizer, policy_loss


def loss_fn_factory(loss_cfg, kl_coef: float = 0.0, ref_logprobs=None):
    """``factory(batch, anchor) -> loss_fn`` for the trainer: the policy loss, plus the reference KL.

    ``ref_logprobs(batch) -> [B, L-1]`` scores the batch with the reference
    policy (needed when ``kl_coef > 0``); the penalty is the k3 estimator
    exp(ref - theta) - (ref - theta) - 1 (Schulman, "Approximating KL
    divergence", 2020), averaged over all policy tokens of the batch.
    """
    def factory(batch, anchor):
        ref = batch.logp_anchor if batch.logp_anchor is not None else batch.logp_behav
        # the global denominator, so that micro-batch losses add up to the full-batch loss
        normalizer = loss_normalizer(ref, batch.logp_behav, batch.loss_mask, loss_cfg)
        if kl_coef > 0:
            batch_ref = ref_logprobs(batch)
            rows = {tid: i for i, tid in enumerate(batch.traj_ids)}
            n_valid = max(float(batch.loss_mask.sum()), 1.0)

        def loss_fn(logp_theta, mb, _counts=None):
            if anchor.from_theta is not None:
                logp_anchor = anchor.from_theta(logp_theta.detach(), mb)
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
            return loss, metrics

        return loss_fn

    return factory


def loss_fn_factory_for_run(cfg, trainer):
    """The loss factory; with a reference KL, the reference is the initial weights of this trainer."""
    if cfg.advantage.kl_coef <= 0:
        return loss_fn_factory(cfg.loss)
    ref_params = trainer.get_params()

    def ref_logprobs(batch):
        with trainer.use_params(ref_params):
            return trainer.logprobs(batch)

    return loss_fn_factory(cfg.loss, cfg.advantage.kl_coef, ref_logprobs)
