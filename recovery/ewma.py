"""ewma (approximate): PPO-EWMA proximal policy (Hilton, Cobbe, Schulman 2021; docs/design.md §3).

The proximal parameters phi are a bias-corrected exponentially weighted moving
average of theta, updated after every optimizer step (n starts at 0)::

    n_new = beta*n + 1;  phi <- phi*(beta*n/n_new) + theta/n_new;  n <- n_new

so theta_k, theta_{k-1}, ... weigh 1, beta, beta^2, ... normalized (beta=0.5
over theta = 1, 2, 3 gives phi = 1, 1.6667, 2.4286). The first batch, before any
step, initializes phi from theta_0 through the same update. The anchor is one
forward with ``trainer.use_params(phi)``.

Where phi lives. By default in the dtype of the weights the forward uses (bf16
on a bf16 run, at half an fp32 copy's bytes) and on the host. A bf16 phi is
updated in fp32 and rounded stochastically (recovery/_stochastic_round.py):
rounding to nearest would swallow every ``theta/n_new`` increment below half a
bf16 unit and leave phi stuck up to ``0.5 * n_new`` units behind theta; rounded
stochastically it is theta's average in expectation, with a spread of about
one unit (the anchor forward rounds phi to bf16 anyway). The draws are seeded
by the version folded in, so DP replicas and a resumed run round alike.
``phi_dtype: float32`` keeps the fp32 average (twice the host bytes).
``phi_on_gpu: true`` keeps phi on the trainer's device: no host copy and no
PCIe traffic per step, at one more shard of GPU memory (`megarl plan` counts
it and refuses a layout it no longer fits; an fp32 phi on a bf16 run adds its
bf16 cast for the forward).

Folding. Each optimizer step's theta is folded in by the next anchor (nothing
writes the parameters in between), not right after the step, and a host phi
is folded on the trainer's device while the anchor swaps it in
(``trainer.use_params_from``): per tensor, theta goes to the host (the copy the
swap restores), phi comes to the device, the fold runs there and its result is
both the tensor the forward uses and, copied back, the host phi of the next
step. Four shard copies over PCIe per step (theta out and back, phi in and
out) and no arithmetic on the host, where folding every parameter of a rank
with stochastic rounding runs at ~75 M elements/s per CPU thread (seconds per
step at 30B). Bit for bit the host fold's result: the same fp32 arithmetic and
draws in the same order. A phi on the trainer's device (``phi_on_gpu``) is
folded there in place, and the forward points the parameters at it
(``use_params_from(resident=True)``): theta stays where it is, nothing is
copied. The fold works :data:`FOLD_CHUNK` elements at a time, so its fp32
temporaries stay small beside a 300M-entry embedding. A
checkpoint taken between a step and the next anchor holds phi without that
step's theta (``phi_version`` says which it holds); the resumed run folds it
in at its first anchor, from the same restored theta and with the same seed.

Default decay. The EWMA's centre of mass lies beta/(1-beta) optimizer steps in
the past; it is placed mid-window, at S/2 steps for a staleness window of S
optimizer steps, giving ``beta = S/(S + 2)`` (design.md §3 writes S = M*W: W
published versions of M = trainer.publish_every optimizer steps each; S = 4 ->
0.667). Units: a version is a count of optimizer steps (the engines receive
trainer.version: 0, 2, 4, ... when publish_every = 2) and rollout.eta bounds a
token's lag ``batch.version - v_t`` in those same optimizer steps (the buffer's
deadline is start version + eta steps). So by default S = rollout.eta + 1 (lags
0..eta) whatever publish_every is; multiplying by M would count it twice. An
explicit ``window`` W is in published versions and S = M*W with M
(``steps_per_version``) defaulting to trainer.publish_every. The loop provides
both as ``RecoveryContext.eta`` / ``RecoveryContext.publish_every``.

Auto-reset. After the anchor forward the active-token fraction (tokens the
train-inference mask keeps, as ``megarl.losses.policy_loss`` reports it under
``ctx.loss_cfg``) is computed; below ``tau`` phi <- theta and n <- 1. Every
trainer rank anchors the same batch and gets the same log-probs, so every
replica of phi takes the same decision. The reset takes effect for the
batch that triggered it: its anchor is recomputed with the reset phi (= theta).
Resets are counted (overhead key ``n_resets``). ``auto_reset: false`` turns
them off (the ablation of Guan et al. 2026, in which the mask's active share can
collapse); the active fraction is logged either way.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megarl.losses import PolicyLossConfig
from megarl.losses.policy import policy_loss
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._scoring import forward, params_nbytes
from recovery._stochastic_round import fold_seed, round_to_bf16
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class EwmaConfig:
    """Options of the PPO-EWMA strategy."""

    beta: float | None = None
    """EWMA decay per optimizer step, in [0, 1); None = S/(S + 2) for a staleness window of S optimizer steps (rollout.eta + 1, or window * steps_per_version), which puts the EWMA's centre of mass mid-window."""
    window: int | None = None
    """W: expected staleness window in published versions, M optimizer steps each (only for the default beta); None = rollout.eta + 1 optimizer steps (eta counts optimizer steps)."""
    steps_per_version: int | None = None
    """M: optimizer steps per published version, used with an explicit window (S = M*W); None = trainer.publish_every."""
    tau: float = 0.5
    """Reset phi <- theta when the active-token fraction under the EWMA anchor falls below tau (0 = never reset)."""
    auto_reset: bool = True
    """false = never reset, whatever the active fraction (the ablation in which the train-inference mask can collapse; the active fraction is still logged as ewma/active_frac_pre and active_frac)."""
    phi_dtype: Literal["param", "float32"] = "param"
    """param = phi in the dtype of the weights the forward uses (bf16 on bf16 runs, updated with stochastic rounding; fp32 on fp32 runs); float32 = an fp32 average whatever the run's dtype (twice the bytes on bf16 runs)."""
    phi_on_gpu: bool = False
    """Keep phi on the trainer's device instead of host memory: no PCIe copies per step, one more parameter shard of GPU memory (the forward points at it; nothing is copied); `megarl plan` says whether it fits."""


def default_beta(window: int, steps_per_version: int = 1) -> float:
    """beta whose EWMA age beta/(1-beta) equals S/2 optimizer steps, S = M*W (W versions of M steps)."""
    mw = steps_per_version * window
    return mw / (mw + 2)


def ewma_update(phi: dict[str, torch.Tensor] | None, n: float, theta: dict[str, torch.Tensor],
                beta: float, *, dtype: torch.dtype = torch.float32,
                generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """One bias-corrected EWMA step (in place on phi); returns (phi, n_new). A new phi is theta in ``dtype``
    on theta's device; a bf16 phi is updated in fp32 and rounded stochastically with ``generator``."""
    keep, take, n_new = fold_weights(beta, n)
    if phi is None or n == 0:
        return {k: t.detach().to(dtype, copy=True) for k, t in theta.items()}, n_new
    for k, p in phi.items():
        fold_tensor(p, theta[k].to(p.device), keep, take, generator, out=p)
    return phi, n_new


def fold_weights(beta: float, n: float) -> tuple[float, float, float]:
    """(keep, take, n_new) of one fold after n: ``phi_new = keep*phi + take*theta``."""
    n_new = beta * n + 1.0
    return beta * n / n_new, 1.0 / n_new, n_new


#: elements folded at once: the fold's fp32 temporaries (the widened phi and theta, the rounding's draws and
#: words: ~16 bytes an element) stay under 256 MB whatever the tensor, an embedding of 300M entries included
FOLD_CHUNK = 1 << 24


def fold_tensor(phi: torch.Tensor, theta: torch.Tensor, keep: float, take: float,
                generator: torch.Generator | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``keep*phi + take*theta`` computed in fp32 on theta's device, in phi's dtype, :data:`FOLD_CHUNK` elements
    at a time, written into ``out`` (contiguous, on theta's device; phi itself when it is there) or a new
    tensor there; a bf16 result is rounded stochastically with ``generator`` (drawn on theta's device)."""
    if phi.dtype == torch.bfloat16 and generator is None:
        raise ValueError("a bf16 phi is rounded stochastically: pass a generator")
    if out is None:
        out = torch.empty(phi.shape, dtype=phi.dtype, device=theta.device)
    src, th, dst = phi.reshape(-1), theta.reshape(-1), out.view(-1)
    for i in range(0, src.numel(), FOLD_CHUNK):
        part = slice(i, i + FOLD_CHUNK)
        # moved in its own dtype, widened where theta is (a cast before the move would double the bytes over PCIe)
        x = src[part].to(theta.device, copy=True).to(torch.float32).mul_(keep)
        x.add_(th[part].to(torch.float32), alpha=take)
        dst[part] = round_to_bf16(x, generator) if phi.dtype == torch.bfloat16 else x.to(phi.dtype)
    return out


@register
class Ewma(RecoveryStrategy):
    name = "ewma"
    Config = EwmaConfig
    exact = False

    def __init__(self, cfg: EwmaConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        self.beta = self._resolve_beta(cfg, ctx)
        self.loss_cfg = ctx.loss_cfg if ctx.loss_cfg is not None else PolicyLossConfig()
        if cfg.auto_reset and cfg.tau > 0 and self.loss_cfg.behav_weight in ("none", "tis"):
            warnings.warn(f"recovery.ewma.tau={cfg.tau} has no effect with loss.behav_weight="
                          f"{self.loss_cfg.behav_weight!r}: no token is masked, the active fraction is always 1",
                          stacklevel=2)
        self._phi: dict[str, torch.Tensor] | None = None
        self._n = 0.0
        #: trainer version of the last theta folded into phi
        self._phi_version: int | None = None
        self.n_resets = 0
        #: optimizer steps whose theta no anchor folded in (after_optimizer_step)
        self.n_missed_folds = 0

    @staticmethod
    def _resolve_beta(cfg: EwmaConfig, ctx: Any) -> float:
        if cfg.beta is not None:
            if not 0.0 <= cfg.beta < 1.0:
                raise ValueError(f"recovery.ewma.beta={cfg.beta} must lie in [0, 1)")
            return cfg.beta
        if cfg.window is None:
            # rollout.eta already counts optimizer steps: lags 0..eta, a window of eta + 1 steps
            return default_beta(ctx.eta + 1)
        steps = cfg.steps_per_version if cfg.steps_per_version is not None else ctx.publish_every
        if cfg.window < 1 or steps < 1:
            raise ValueError(f"recovery.ewma.window={cfg.window} and steps_per_version={steps} must be >= 1")
        return default_beta(cfg.window, steps)

    # -- the average -------------------------------------------------------------
    def _phi_dtype(self) -> torch.dtype:
        bf16 = self.cfg.phi_dtype == "param" and self.ctx.trainer.dtype == "bfloat16"
        return torch.bfloat16 if bf16 else torch.float32

    def _init_phi(self) -> None:
        """phi = the trainer's current theta (n: 0 -> 1): a copy where phi lives, in phi's dtype."""
        trainer = self.ctx.trainer
        theta = trainer.get_params(device=None if self.cfg.phi_on_gpu else "cpu")
        self._phi = {k: t.to(self._phi_dtype()) for k, t in theta.items()}  # the copy itself where dtypes agree
        self._n, self._phi_version = fold_weights(self.beta, 0.0)[2], trainer.version

    def _fold_generator(self, device: torch.device) -> torch.Generator:
        """The stochastic rounding's draws of the fold of the trainer's current version, on ``device``."""
        gen = torch.Generator(device=device)
        gen.manual_seed(fold_seed(0, self.ctx.trainer.version))
        return gen

    def _reset(self) -> None:
        self._phi, self._n = None, 0.0  # the old phi goes before the new copy is taken
        self._init_phi()
        self.n_resets += 1
        self.meter.add("n_resets", 1.0)

    def _phi_params(self) -> dict[str, torch.Tensor] | None:
        """phi, or None when phi is exactly the trainer's current theta (no swap needed)."""
        return None if self._n == 1.0 and self._phi_version == self.ctx.trainer.version else self._phi

    def _active_frac(self, batch: TrainBatch, logp_anchor: torch.Tensor) -> float:
        logp_anchor = logp_anchor.to(batch.loss_mask.device)
        _, m = policy_loss(logp_anchor, logp_anchor, batch.logp_behav, batch.advantages, batch.loss_mask,
                           self.loss_cfg)
        return m["active_frac"]

    # -- hooks -------------------------------------------------------------------
    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        # the fold of the step's theta waits for the next anchor (module doc, "Folding"), which the loop calls
        # before every optimizer step; a step without one leaves a theta out of the average
        if self._phi is not None and self._phi_version is not None and self._phi_version < version - 1:
            self.n_missed_folds += 1
            self.meter.add("n_missed_folds", 1.0)
            if self.n_missed_folds == 1:
                warnings.warn(f"recovery.ewma: optimizer step {version} came without an anchor since version "
                              f"{self._phi_version}: the theta of version {version - 1} was not folded into phi",
                              stacklevel=2)

    def _forward_folding(self, batch: TrainBatch) -> torch.Tensor:
        """The anchor forward with phi in place of theta, folding the trainer's current theta into phi on the
        trainer's device tensor by tensor first (module doc, "Folding")."""
        trainer = self.ctx.trainer
        keep, take, n_new = fold_weights(self.beta, self._n)
        gen: list[torch.Generator] = []  # made at the first tensor, on the parameters' device
        resident = self.cfg.phi_on_gpu

        def fold(name: str, theta: torch.Tensor) -> torch.Tensor:
            gen[:] = gen or [self._fold_generator(theta.device)]
            phi = self._phi[name]
            if resident:  # folded in place on the device; the forward points at it (in the forward's dtype)
                if phi.device != theta.device:  # restored from a checkpoint: it comes in once
                    phi = self._phi[name] = phi.to(theta.device)
                fold_tensor(phi, theta, keep, take, gen[0], out=phi)
                return phi if phi.dtype == theta.dtype else phi.to(theta.dtype)
            new = fold_tensor(phi, theta, keep, take, gen[0])
            phi.copy_(new)  # the host phi, for the next step
            return new

        with trainer.use_params_from(fold, resident=resident):
            logp = trainer.logprobs(batch)
        self._n, self._phi_version = n_new, trainer.version
        return logp

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        with self.meter.time("recovery_s"):
            # the theta of the last optimizer step is folded in here, by the anchor, not right after the step
            # (module doc, "Folding")
            with torch.no_grad():
                if self._phi is None:
                    self._init_phi()  # phi = theta_0
                if self._phi_version != self.ctx.trainer.version:
                    logp = self._forward_folding(batch)
                else:  # nothing to fold (the first anchor, or one more of the same version)
                    logp = forward(self.ctx.trainer, batch, self._phi_params())
                active = self._active_frac(batch, logp)
                reset = self.cfg.auto_reset and self.cfg.tau > 0 and active < self.cfg.tau
                if reset:
                    self._reset()
                    logp = self.ctx.trainer.logprobs(batch)
        self._report()
        return AnchorResult(logp_anchor=logp, exact=False,
                            metrics={"ewma/active_frac_pre": active, "ewma/reset": float(reset),
                                     "ewma/n": self._n, "ewma/beta": self.beta})

    def _report(self) -> None:
        self.meter.set("bytes_held", float(params_nbytes(self._phi)) if self._phi is not None else 0.0)
        self.meter.set("extra_param_copies", 1.0 if self._phi is not None else 0.0)

    def overhead(self) -> dict[str, float]:
        self._report()
        return super().overhead()

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"phi": None if self._phi is None else {k: t.to("cpu", copy=True) for k, t in self._phi.items()},
                "n": self._n, "phi_version": self._phi_version, "n_resets": self.n_resets, "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        phi = state["phi"]
        # in this run's dtype (a checkpoint of phi_dtype=float32 too); it moves to the trainer's device at its
        # next fold when phi_on_gpu
        self._phi = None if phi is None else {k: t.to(self._phi_dtype()) for k, t in phi.items()}
        self._n = float(state["n"])
        self._phi_version = state["phi_version"]
        self.n_resets = int(state["n_resets"])
        if abs(state["beta"] - self.beta) > 1e-12:
            warnings.warn(f"recovery.ewma: restored phi was averaged with beta={state['beta']:.4f}, "
                          f"continuing with beta={self.beta:.4f}", stacklevel=2)
        self._report()
