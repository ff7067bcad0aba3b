"""MegatronTrainer: megatron-core GPTModel + Megatron DDP + Megatron optimizer, for RL.

Importing this module initializes nothing; constructing a trainer does
(torch.distributed, megatron parallel_state, model, weights). Every rank of
the job constructs one and calls the same methods with the same TrainBatch.

Work split. Every rank plans the batch's micro-batches alike (megarl/trainer/packing.py: the same count
on every DP rank, balanced on a compute estimate) and runs megatron's schedule over its share.

Loss semantics of :meth:`train_step`: the gradient is exactly the gradient of
the SUM of the losses ``loss_fn`` returns over all micro-batches of all DP
ranks. megatron-core 0.16.1 divides each micro-batch loss by the number of
micro-batches (and DDP averages over DP) unless
``config.calculate_per_token_loss`` is set; megarl sets it, which makes the
schedule keep losses as returned and DDP sum gradients, and runs
``finalize_model_grads`` without its per-token division. ``loss_fn`` gets the
global counts (``normalizer``) to build means itself.

Precision (``dtype``). ``float32``: parameters, gradients and optimizer are
fp32. ``bfloat16``: Megatron-LM's mixed-precision recipe: TransformerConfig
``bf16=True`` with bf16 ``params_dtype``, the GPTModel wrapped in
``Float16Module`` (bf16 forward, fp32 outputs), DDP gradient buffers in fp32
(``grad_reduce_in_fp32``) and an optimizer holding fp32 main parameters
(``Float16OptimizerWithFloat16Params``, or the distributed optimizer's fp32
shards) that are copied back to the bf16 model after every step. Log-probs
are computed in fp32 in either case: megatron's ``vocab_parallel_cross_entropy``
casts the (bf16) logits to fp32 before its log-softmax.

Temperature. The engines report ``logp_behav`` of the distribution they
sampled from, softmax(logits / T) (megarl/rollout/base.py), so every log-prob
the trainer computes, ``logp_theta`` in :meth:`train_step` and
:meth:`logprobs` (the forwards of every recovery strategy, the verifier and
the reference KL), is taken at the same ``temperature``: the fp32 logits are
divided by it before the log-softmax (megarl/models/entropy.py ``install``).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megarl.errors import ConfigError, InputError
from megarl.models import entropy
from megarl.models.bridge import export_hf_weights, load_hf_weights, read_hf_config, save_hf_checkpoint
from megarl.models.build import grouped_gemm, use_transformer_engine
from megarl.models.hf_config import is_moe, transformer_config_from_hf, validate_parallel
from megarl.platform.batch_invariant import enable_in_trainer
from megarl.trainer import routing_replay
from megarl.trainer.chunks import build_chunks
from megarl.trainer.dist_state import load_reshardable, save_reshardable
from megarl.trainer.layouts import model_inputs, row_lengths, schedule_shape
from megarl.trainer.metrics import reduce_metrics
from megarl.trainer.microbatch import MicroBatch, plan_microbatches
from megarl.trainer.packing import linear_weight_from_hf, resolve_layout
from megarl.trainer.parallel import comm_device, init_distributed, init_parallel
from megarl.trainer.param_copies import ParamCopies

# megatron.core is imported inside the methods that use it: only after init_parallel() has run
# megarl.platform.megatron.prepare_megatron() (the CPU adaptations and the TransformerEngine guard come first).

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, object, dict], tuple]
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
#: the parameter dtypes the trainer runs in (module doc, "Precision")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MegatronTrainer(ParamCopies):
    """Policy trainer on megatron-core (dense Qwen3 and Qwen3-MoE; TP/PP/EP/DP).

    ``recompute`` (none, selective, full) trades backward compute for activation memory
    (megarl/models/hf_config.py recompute_fields); ``forward_only`` builds a scorer that can
    only compute log-probs (megarl/trainer/chunks.py).
    """

    def __init__(self, checkpoint_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, adam_eps: float = 1e-8,
                 grad_clip: float = 1.0, micro_batch_tokens: int = 4096, seed: int = 0,
                 use_distributed_optimizer: bool = False, lr_warmup_steps: int = 0, lr_decay: str = "constant",
                 total_steps: int | None = None, min_lr: float = 0.0, dtype: str = "float32",
                 sequence_parallel: bool = False, temperature: float = 1.0, recompute: str = "none",
                 forward_only: bool = False, allow_local_spec: bool = False, batch_invariant: bool = False,
                 packing: str = "auto"):
        if lr_decay not in LR_DECAY_STYLES:
            raise ConfigError(f"lr_decay {lr_decay!r} is not one of {', '.join(LR_DECAY_STYLES)}")
        if lr_decay in ("linear", "cosine") and not total_steps:
            raise ConfigError(f"lr_decay={lr_decay!r} needs total_steps")
        if micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature} (greedy sampling reports raw "
                              f"log-probs: score those with temperature 1)")
        self.checkpoint_dir = str(checkpoint_dir)
        self.hf_config = read_hf_config(checkpoint_dir)
        init_distributed()  # the world size is needed to validate the layout before megatron builds groups
        validate_parallel(self.hf_config, tp, pp, ep, dist.get_world_size())
        # megatron's MoE layer needs sequence parallelism with TP > 1 (megarl/models/sp_norm.py)
        sequence_parallel = tp > 1 and (sequence_parallel or is_moe(self.hf_config))
        self.parallel = init_parallel(tp=tp, pp=pp, ep=ep, seed=seed)
        #: "float32" or "bfloat16": the dtype of the model's parameters (and of exported weights)
        self.dtype = dtype
        #: log-probs are of softmax(logits / temperature): the engines' sampling temperature (module doc)
        self.temperature = float(temperature)
        self.config = transformer_config_from_hf(self.hf_config, tp=tp, pp=pp, ep=ep, dtype=DTYPES[dtype],
                                                 sequence_parallel=sequence_parallel, recompute=recompute,
                                                 grouped_gemm=grouped_gemm())
        # keep returned losses as they are and sum DP gradients (module doc)
        self.config.calculate_per_token_loss = True
        #: rollout.batch_invariant (megarl/platform/batch_invariant.py); a dedicated scorer is built in the same mode
        self.batch_invariant = bool(batch_invariant)
        if batch_invariant:  # before the model is built
            enable_in_trainer(self.config)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.packing = resolve_layout(packing, use_transformer_engine())
        self.linear_weight = linear_weight_from_hf(self.hf_config)
        self.grad_clip = float(grad_clip)
        self._opt_args = dict(lr=lr, betas=betas, weight_decay=weight_decay, adam_eps=adam_eps, min_lr=min_lr,
                              use_distributed_optimizer=use_distributed_optimizer, warmup=lr_warmup_steps,
                              decay=lr_decay, total_steps=total_steps)
        #: a scorer: no gradient buffer, no optimizer, train_step refused (megarl/trainer/chunks.py)
        self.forward_only = bool(forward_only)
        #: megatron's local layers on CUDA without TransformerEngine (megarl/models/build.py)
        self.allow_local_spec = bool(allow_local_spec)
        self.model = build_chunks(self.hf_config, self.config, self.temperature, forward_only=self.forward_only,
                                  use_distributed_optimizer=use_distributed_optimizer,
                                  allow_local_spec=self.allow_local_spec)
        #: MoE layers whose routers can replay an engine's routes (0: dense; megarl/trainer/routing_replay.py)
        self.n_moe_layers = routing_replay.install(self.model)
        load_hf_weights(self.model, checkpoint_dir, self.hf_config, self.config)
        self.optimizer = None  # built on the first train_step: logprobs-only users never pay for it
        self.scheduler = None
        #: optimizer steps taken (the policy version of the current parameters)
        self.version = 0
        self.last_skip_reason: str | None = None

    # -- construction ------------------------------------------------------------------
    def _ensure_optimizer(self) -> None:
        if self.optimizer is not None:
            return
        if self.forward_only:
            raise ConfigError("this trainer was built forward_only (a scorer): it has no gradients to train with")
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self._opt_args
        # bf16=True selects the optimizers with fp32 main params (Float16OptimizerWithFloat16Params, or
        # the distributed optimizer's fp32 shards); bf16 needs no loss scaling
        opt_config = OptimizerConfig(optimizer="adam", lr=a["lr"], min_lr=a["min_lr"],
                                     weight_decay=a["weight_decay"], adam_beta1=a["betas"][0],
                                     adam_beta2=a["betas"][1], adam_eps=a["adam_eps"], clip_grad=self.grad_clip,
                                     bf16=self.config.bf16, params_dtype=self.config.params_dtype,
                                     use_distributed_optimizer=a["use_distributed_optimizer"])
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self.config.grad_scale_func = self.optimizer.scale_loss
        decay_steps = max(int(a["total_steps"] or 0), a["warmup"] + 1, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if a["warmup"] else a["lr"], max_lr=a["lr"], min_lr=a["min_lr"],
            lr_warmup_steps=a["warmup"], lr_decay_steps=decay_steps, lr_decay_style=a["decay"],
            start_wd=a["weight_decay"], end_wd=a["weight_decay"], wd_incr_steps=1, wd_incr_style="constant")

    # -- forward passes -----------------------------------------------------------------
    def _check_batch(self, batch) -> None:
        max_pos = int(self.hf_config["max_position_embeddings"])
        lens = [int(n) for n in batch.seq_lens]
        if min(lens) < 2:
            raise InputError(f"row {lens.index(min(lens))} has {min(lens)} token(s); log-probs need >= 2")
        if max(lens) > max_pos:
            raise InputError(f"row {lens.index(max(lens))} has {max(lens)} tokens > max_position_embeddings {max_pos}")
        vocab = int(self.hf_config["vocab_size"])
        lo, hi = int(batch.tokens.min()), int(batch.tokens.max())
        if lo < 0 or hi >= vocab:
            raise InputError(f"token ids must be in [0, {vocab}); got range [{lo}, {hi}]")

    def _run(self, batch, loss_func_for: Callable, forward_only: bool, with_entropy: bool = False) -> list:
        """megatron forward(-backward) over this DP rank's micro-batches; returns the last stage's outputs.
        ``loss_func_for`` gets the cross entropy [b, n], or [b, n, 2] (with the entropy) ``with_entropy``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = plan_microbatches(batch, self.parallel.dp_rank, self.parallel.dp, self.micro_batch_tokens,
                                device=comm_device(), layout=self.packing, linear_weight=self.linear_weight)

        # sequence parallelism splits the sequence over TP ranks: inputs are padded to a multiple of tp at
        # the end (causal attention: real positions never see the padding) and outputs cut back
        multiple = self.parallel.tp if self.config.sequence_parallel else 1
        split = (self.parallel.tp_rank, self.parallel.tp) if self.config.sequence_parallel else None
        # full recompute reruns each layer's forward in the backward: its routers must replay the routes again
        recompute = self.config.recompute_granularity == "full" and not forward_only and batch.routes is not None

        def forward_step(data_iterator: Iterator[MicroBatch], model):
            mb = next(data_iterator)
            # the padded rectangle or THD packed rows (megarl/trainer/layouts.py)
            inp = model_inputs(self.packing, mb.tokens, row_lengths(mb), None if mb.batch is None else mb.batch.routes,
                               multiple)
            routes = routing_replay.forward_routes(inp.routes, inp.n, inp.pad, self.n_moe_layers, split)
            # labels make the last stage return per-token cross entropy (vocab-parallel under TP) = -logp
            with routing_replay.replaying([model], routes, n_layers=int(self.hf_config["num_hidden_layers"]),
                                          recompute=recompute):
                out = model(**inp.kwargs)
            return out, lambda output: loss_func_for(mb, inp.unpack(output))

        fb = get_forward_backward_func()
        seq_length, micro_batch_size = schedule_shape(self.packing, mbs, multiple)
        with routing_replay.fresh(self.model), entropy.returning_entropy(self.model, on=with_entropy):
            return fb(forward_step_func=forward_step, data_iterator=iter(mbs), model=self.model,
                      num_microbatches=len(mbs), seq_length=seq_length, micro_batch_size=micro_batch_size,
                      forward_only=forward_only)

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        """log p(tokens[t+1] | tokens[..t]) as [B, L-1] fp32 on CPU, on every rank (0 past each row's end)."""
        from megatron.core import parallel_state as ps

        self._check_batch(batch)
        B, L = batch.tokens.shape
        out = torch.zeros(B, L - 1, dtype=torch.float32, device=comm_device())

        def loss_func(mb: MicroBatch, ce: torch.Tensor):
            return ce.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"mb": mb, "logp": -ce.detach().float()}

        for item in self._run(batch, loss_func, forward_only=True):
            mb = item["mb"]
            if not mb.dummy:
                out[mb.rows, : item["logp"].shape[1]] = item["logp"].to(out.device)
        # rows live on their DP rank's last PP stage: broadcast along PP, then sum the disjoint DP rows
        if self.parallel.pp > 1:
            dist.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if self.parallel.dp > 1:
            dist.all_reduce(out, group=ps.get_data_parallel_group())
        positions = torch.arange(L - 1).unsqueeze(0)
        return out.cpu().masked_fill(positions >= (batch.seq_lens.view(-1, 1).cpu() - 1), 0.0)

    # -- training -----------------------------------------------------------------------
    def train_step(self, batch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on ``batch``; see the module doc for the loss semantics.

        ``loss_fn(logp_theta [b, l-1] with grad, mb: TrainBatch, normalizer) -> (loss, metrics)``
        with ``normalizer = {"n_valid_tokens", "n_seqs"}`` (global counts over the batch). A ``loss_fn``
        whose ``wants_entropy`` attribute is true is also given ``entropy=`` [b, l-1] with grad: the
        policy's entropy at each position, at the sampling temperature (megarl/models/entropy.py).
        Returns metrics averaged over micro-batches plus ``loss`` (sum of losses), ``grad_norm``
        (before clipping), ``lr`` and ``skipped`` (1.0 when the step was not applied because the
        loss or the gradient norm was not finite; ``skipped_nonfinite_loss`` /
        ``skipped_nonfinite_grad_norm`` and ``self.last_skip_reason`` say which).
        """
        self._check_batch(batch)
        self._ensure_optimizer()
        normalizer = {"n_valid_tokens": float(batch.loss_mask.sum()), "n_seqs": float(batch.size)}
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        with_entropy = bool(getattr(loss_fn, "wants_entropy", False))

        def loss_func(mb: MicroBatch, out: torch.Tensor):
            ce, ent = (out[..., 0], out[..., 1]) if with_entropy else (out, None)
            logp = -ce.float()
            if mb.dummy:  # weight-0 filler keeps MoE collectives aligned across DP ranks
                return out.float().sum() * 0.0, torch.tensor(1, dtype=torch.int), {"dummy": True}
            extra = {"entropy": ent} if with_entropy else {}
            loss, metrics = loss_fn(logp, mb.batch, normalizer, **extra)
            if loss.dim() != 0:
                raise InputError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
            return loss, torch.tensor(1, dtype=torch.int), {"loss": loss.detach(), "metrics": metrics}

        outputs = self._run(batch, loss_func, forward_only=False, with_entropy=with_entropy)
        metrics, loss_sum = reduce_metrics(outputs, dp=self.parallel.dp, pp=self.parallel.pp)
        # every rank must take the same skip decision: the loss lives on the last PP stage only
        bad_loss = torch.tensor([0.0 if math.isfinite(loss_sum) else 1.0], device=comm_device())
        dist.all_reduce(bad_loss, op=dist.ReduceOp.MAX)
        lr = self._set_lr()
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm() or 0.0)
        reason = ("non-finite loss" if bad_loss.item() else
                  "non-finite grad norm" if found_inf or not math.isfinite(grad_norm) else None)
        if reason is None:
            self._clip(grad_norm)
            self.before_param_write()  # kept host copies of these parameters finish first
            self.optimizer.step_with_ready_grads()
            self.version += 1
        else:
            log.warning("train_step skipped at version %d: %s", self.version, reason)
        self.last_skip_reason = reason
        for chunk in self.model:
            chunk.zero_grad_buffer()
        metrics.update(loss=loss_sum, grad_norm=grad_norm, lr=lr, skipped=float(reason is not None),
                       skipped_nonfinite_loss=float(reason == "non-finite loss"),
                       skipped_nonfinite_grad_norm=float(reason == "non-finite grad norm"))
        return metrics

    def _set_lr(self) -> float:
        # the lr of optimizer step k (0-based) depends on k only: warmup reaches max_lr at step warmup-1
        self.scheduler.num_steps = self.version
        self.scheduler.step(1)
        return float(self.optimizer.param_groups[0]["lr"])

    def _clip(self, grad_norm: float) -> None:
        if self.grad_clip <= 0:
            return
        from megatron.core.optimizer import clip_grads

        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in opts:
            params = opt.get_parameters()
            if params:
                use_decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                clip_grads.clip_grad_by_total_norm_fp32(params, self.grad_clip, grad_norm, use_decoupled)

    # -- checkpoints --------------------------------------------------------------------
    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def save_state(self, out_dir: str) -> dict:
        """The model, optimizer, scheduler step, version and RNG in ``out_dir``, reshardable
        (megarl/trainer/dist_state.py); a collective of every trainer rank."""
        return save_reshardable(self, out_dir)

    def _layout(self) -> dict:
        p = self.parallel
        return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "dp": p.dp,
                "distributed_optimizer": bool(self._opt_args["use_distributed_optimizer"])}

    def load_state(self, in_dir: str) -> None:
        """Inverse of :meth:`save_state` into this trainer's layout (a directory of the earlier per-rank
        format: the same layout only); CheckpointError names what is missing or does not fit."""
        self.before_param_write()
        load_reshardable(self, in_dir)

    # -- weights ------------------------------------------------------------------------
    def _module(self):
        module = self.model[0]
        while hasattr(module, "module"):
            module = module.module
        return module

    def load_hf_checkpoint(self, ckpt_dir: str) -> None:
        """Load the weights of an HF checkpoint (as :meth:`save_hf_checkpoint` writes) into this rank's shards;
        the optimizer is left as it is (a scorer of old versions has none)."""
        self.before_param_write()
        load_hf_weights(self.model, ckpt_dir, self.hf_config, self.config)

    def export_hf_weights(self, *, to_host: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (HF name, full tensor); a collective every rank must consume (see bridge.export_hf_weights)."""
        return export_hf_weights(self.model, self.hf_config, self.config, to_host=to_host)

    def save_hf_checkpoint(self, out_dir: str):
        """Write an HF checkpoint (config.json + model.safetensors) of the current weights; rank 0 writes."""
        return save_hf_checkpoint(self.model, out_dir, self.exported_hf_config(), self.config)

    def exported_hf_config(self) -> dict:
        """config.json of the exported weights: its dtype field says what they are (an engine started
        with ``--dtype auto`` loads that)."""
        hf = dict(self.hf_config)
        for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["dtype"]:
            hf[key] = self.dtype
        return hf
