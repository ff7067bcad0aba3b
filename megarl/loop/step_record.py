"""What one step of the loop leaves behind: the train step on a batch and its metrics, the step record,
decoded samples, the check of failed episodes and the stall message.

:class:`StepBookkeeping` is a collaborator of :class:`megarl.loop.controller.Controller` (its ``bookkeeping``),
given the run's ``cfg``, ``trainer``, ``strategy``, ``loss_fn_factory``, ``router``, ``workflow``, ``buffer``,
``journal`` and ``tokenizer``, the loop's ``counters`` and ``failures`` (the window of episode outcomes) and the
engines' ``published`` version; the step, and what the controller keeps of it (``gen_stall_s``, the steps skipped
in a row), come with each call. It owns the step boundary of the counters (``step_counters``, in the loop's
checkpoint) and of the workflow's stats.
"""
from __future__ import annotations

import time
from typing import Any

from megarl.errors import TrainingError
from megarl.failure_causes import FailureWindow
from megarl.loop.buffer import PublishedVersion
from megarl.losses.mismatch import behav_weight_stats, discrepancy
from megarl.routes import stored_bytes
from megarl.types import TrainBatch, Trajectory, training_rows


class StepBookkeeping:
    """The controller's per-step accounting (module doc)."""

    def __init__(self, cfg, *, trainer, strategy, loss_fn_factory, router, workflow, buffer, journal, tokenizer,
                 counters: dict[str, int], failures: FailureWindow, published: PublishedVersion) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.strategy = strategy
        self.loss_fn_factory = loss_fn_factory
        self.router = router
        self.workflow = workflow
        self.buffer = buffer
        self.journal = journal
        self.tokenizer = tokenizer
        self.counters = counters
        self.failures = failures
        self.published = published
        self.B = cfg.trainer.batch_size
        self.eta = cfg.rollout.eta
        self.step_counters = dict(counters)  # the counters at the last step record; a step reports what they gained
        self._prev_workflow_stats: dict[str, int] = {}

    @property
    def entropy_control(self):
        """The loss's entropy coefficient (megarl/losses/entropy_control.py); None for a loss without one."""
        return getattr(self.loss_fn_factory, "entropy_control", None)

    def loss_state(self) -> dict[str, Any]:  # an adaptive entropy coefficient, in the loop's checkpoint
        return {"loss": self.entropy_control.state_dict()} if self.entropy_control is not None else {}

    def load_loss_state(self, state: dict[str, Any]) -> None:
        if self.entropy_control is not None and "loss" in state:
            self.entropy_control.load_state_dict(state["loss"])

    def train_on(self, trajs: list[Trajectory]) -> dict[str, Any]:
        batch = TrainBatch.from_trajectories(trajs, version=self.trainer.version)
        t0 = time.perf_counter()
        anchor = self.strategy.anchor(batch, trajs)
        t_anchor = time.perf_counter()
        if anchor.logp_anchor is not None:
            batch.logp_anchor = anchor.logp_anchor
        loss_fn = self.loss_fn_factory(batch, anchor)
        metrics = self.trainer.train_step(batch, loss_fn)
        t_step = time.perf_counter()
        metrics = dict(metrics)
        control = self.entropy_control
        if control is not None and control.active:  # the coefficient this step used, then the next step's
            metrics["entropy_coef"] = float(loss_fn.entropy_coef)
            if not metrics.get("skipped"):
                control.observe(metrics.get("entropy"))
        metrics.update(anchor.metrics)
        metrics["anchor_exact"] = float(anchor.exact)
        metrics["recovery_s"] = t_anchor - t0
        metrics["train_step_s"] = t_step - t_anchor
        metrics.update(self._mismatch(batch, anchor))
        mask = batch.loss_mask > 0
        if batch.logp_old is not None and anchor.logp_anchor is not None:
            known = mask & batch.logp_old.isfinite()
            if known.any():
                metrics["abs_logp_anchor_minus_old_mean"] = float(
                    (anchor.logp_anchor - batch.logp_old)[known].abs().mean())
        lag = (batch.version - batch.versions)[mask]
        metrics["staleness_max"] = int(lag.max()) if lag.numel() else 0
        metrics["staleness_mean"] = float(lag.float().mean()) if lag.numel() else 0.0
        metrics["version_lag_hist"] = {int(k): int(v) for k, v in zip(*lag.unique(return_counts=True))}
        return metrics

    def _mismatch(self, batch: TrainBatch, anchor) -> dict[str, float]:
        """r_d where logp_old is known (an exact anchor, or logp_old the strategy filled in) and what the
        train-inference rule does with the anchor the loss uses (megarl/losses/mismatch.py). An anchor computed
        from logp_theta inside the forward (loglinear, linear) is not known here: the loss reports its mean."""
        out: dict[str, float] = {}
        if anchor.logp_anchor is not None:
            out.update(behav_weight_stats(anchor.logp_anchor, batch.logp_behav, batch.loss_mask, self.cfg.loss))
        old = anchor.logp_anchor if anchor.exact else batch.logp_old
        if old is not None:
            out.update(discrepancy(old, batch.logp_behav, batch.loss_mask))
        return out

    def failure_error(self, step: int) -> TrainingError | None:
        """The error to stop with when more than reward.max_fail_frac of the last B episodes failed, naming what
        failed (an agent, the reward function) and the fix (megarl/failure_causes.py)."""
        return self.failures.error(step, self.cfg, self.workflow)

    def log_samples(self, trajs: list[Trajectory], step: int) -> None:
        """``logging.log_samples`` trajectories of the step as decoded text, to ``samples.jsonl``."""
        n = self.cfg.logging.log_samples
        if n <= 0 or self.journal is None or self.tokenizer is None:
            return
        tok = self.tokenizer
        for t in trajs[:n]:
            self.journal.write("samples", {
                "step": step, "traj_id": t.traj_id, "prompt": tok.decode_prompt(t.prompt_ids),
                "response": tok.decode_response(t.response_ids), "reward": t.reward,
                "answer": t.meta.get("answer"), "finish_reason": t.finish_reason,
                # [version, number of tokens] per segment, in order: which weights wrote which part
                "versions": [[g.version, g.end - g.start] for g in t.segments()]})

    def journal_trained(self, trajs: list[Trajectory], skipped: bool, step: int) -> None:
        """The step's rows to ``trained_ids.jsonl``: what resume and the no-loss checks read."""
        if self.journal is None:
            return
        self.journal.write("trained_ids", {"step": step, "version": self.trainer.version,
                                           "skipped": skipped, "traj_ids": [t.traj_id for t in trajs],
                                           # the rows' lengths as the trainer packs them (bench --packing)
                                           "n_tokens": [len(t.prompt_ids) + len(t.response_ids) for t in trajs]})

    def _workflow_step_stats(self) -> dict[str, int]:
        """What the workflow counted (agent turns, tool calls, failures) since the last step."""
        now = self.workflow.stats()
        step = {k: v - self._prev_workflow_stats.get(k, 0) for k, v in now.items()}
        self._prev_workflow_stats = now
        return step

    def step_record(self, trajs, t0, t_got, t_trained, t_start, *, step: int, gen_stall_s: float) -> dict[str, Any]:
        rewards = [t.reward for t in trajs if t.reward is not None]
        step_counts = {k: self.counters[k] - self.step_counters[k] for k in self.counters}
        self.step_counters = dict(self.counters)
        resp_lens = [t.n_policy_tokens for t in trajs]
        return {
            "step": step,
            "version": self.trainer.version,
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "n_spliced": sum(t.is_spliced for t in trajs),
            "tokens": sum(resp_lens),
            "response_len_mean": sum(resp_lens) / max(len(resp_lens), 1),
            "response_len_max": max(resp_lens) if resp_lens else 0,
            "wait_batch_s": t_got - t0,
            "step_s": time.perf_counter() - t0,
            "trainer_busy_s": t_trained - t_got,
            "wall_s": time.perf_counter() - t_start,
            "gen_stall_total_s": gen_stall_s,
            **step_counts,
            **self._workflow_step_stats(),
            **self.router.stats(),
            **{f"recovery/{k}": v for k, v in self.strategy.overhead().items()},
            **_route_bytes(trajs),
        }

    def skips_error(self, last_reason: str, max_skips: int, *, consecutive: int, step: int) -> TrainingError:
        return TrainingError(
            f"{consecutive} consecutive steps skipped (last: {last_reason}, step {step}, version "
            f"{self.trainer.version}); stopping (trainer.max_consecutive_skips={max_skips}). A checkpoint of this "
            f"step is in the run directory: lower trainer.lr or check the rewards, then resume with --resume")

    def stall_message(self, timeout: float, step: int) -> str:
        version = self.published.value
        g = self.buffer.gate_state(version)
        filtered = self.counters["n_filtered"] - self.step_counters["n_filtered"]
        dropped = self.counters["n_dropped"] - self.step_counters["n_dropped"]
        if filtered or dropped:  # groups finish but none is kept: neither engines nor rewards are stuck
            cause = (f"Since the last step {filtered} samples were filtered (rollout.filter_groups: all rewards of "
                     f"their group equal, e.g. a constant reward) and {dropped} dropped (failed generation, "
                     f"non-finite advantages or reward.on_failure=drop), and none was kept: check that reward.fn "
                     f"tells samples apart on this data (data.answer_key), or set rollout.filter_groups=false")
        else:
            cause = ("A full gate with nothing running means no batch can ever form (check rollout.eta and "
                     "trainer.publish_every); otherwise the engines or the rewards are stuck (for very long "
                     "generations raise trainer.stall_timeout_s)")
        return (f"no batch for step {step}: the trainer waited {timeout:.1f} s (trainer.stall_timeout_s) and no "
                f"trajectory was accepted meanwhile. Staleness gate: accepted {g['accepted']} + running "
                f"{g['running']} of capacity {g['capacity']} = (rollout.eta {self.eta} + version {version} + 1) "
                f"x trainer.batch_size {self.B} (released by skipped steps {g['released']}); ready {g['ready']} of "
                f"{self.B}; trainer version {self.trainer.version}; filtered {self.counters['n_filtered']}, dropped "
                f"{self.counters['n_dropped']} in all. {cause}. A checkpoint of this step is in the run directory; "
                f"resume it with --resume")


def _route_bytes(trajs: list[Trajectory]) -> dict[str, float]:
    """With routing replay: bytes of MoE routes kept per token of the batch's rows and per spliced row."""
    rows = training_rows(trajs)
    stored = [stored_bytes(t.route_segments) for t in rows]
    if not any(stored):
        return {}
    spliced = [b for t, b in zip(rows, stored) if t.is_spliced]
    return {"routes/bytes_per_token": sum(stored) / max(sum(len(t.tokens) for t in rows), 1),
            "routes/bytes_per_spliced_row": sum(spliced) / len(spliced) if spliced else 0.0}

