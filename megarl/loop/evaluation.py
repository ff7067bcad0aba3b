"""Evaluation during training: held-out prompts, k samples each, scored by the run's reward.

The controller starts an evaluation every ``eval.every`` steps and once at the
end, one at a time: one due while the last still runs is skipped (counted in
``eval/n_skipped``). Its requests go to the same engines through the same
interruptible generate path as training rollouts (so a publish in the middle
resumes them with the new weights, and ``eval/version_min``/``version_max``
say which versions produced the tokens), but they never pass the staleness
gate, never enter the replay buffer and are never seen by a recovery strategy.
A sample that raises fails the evaluation (logged; training goes on) and
cancels every other sample of it at once (megarl/loop/group_tasks.py).

Metrics (per evaluation, logged under ``eval/``): ``reward_mean`` over all
samples (the reward an agent gave its episode, else the scorer's; a failed
agent episode or a non-finite reward counts 0 and in ``n_reward_failed``);
``pass@1`` = mean over prompts of c/n; ``pass@k`` with k = n (the samples per
prompt) = mean over prompts of 1 - C(n-c, k)/C(n, k), the unbiased
estimator of Chen et al. 2021 (arXiv 2107.03374), where c samples of a prompt
have reward >= ``eval.pass_threshold``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Awaitable, Callable

from megarl.data import Prompt
from megarl.loop.group_tasks import gather_or_cancel
from megarl.types import Trajectory

log = logging.getLogger("megarl.loop.controller")

GenerateFor = Callable[[Trajectory], Callable[..., Awaitable[Any]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluator:
    """Runs ``workflow`` on every prompt ``n_samples`` times and scores the results with ``scorer``."""

    def __init__(self, prompts: list[Prompt], workflow: Any, scorer: Any, *, n_samples: int,
                 pass_threshold: float) -> None:
        if n_samples < 1:
            raise ValueError(f"eval.n_samples must be >= 1, got {n_samples}")
        self.prompts = prompts
        self.workflow = workflow
        self.scorer = scorer
        self.n_samples = n_samples
        self.pass_threshold = pass_threshold
        self.n_runs = 0
        #: evaluations the schedule skipped because the one before was still running (eval/n_skipped)
        self.n_skipped = 0

    async def run(self, generate_for: GenerateFor) -> dict[str, float]:
        """One evaluation; ``generate_for(traj)`` is the generate function a workflow uses for ``traj``."""
        t0 = time.perf_counter()
        run = self.n_runs
        self.n_runs += 1

        async def one(p: Prompt, j: int) -> Trajectory:
            traj = Trajectory(traj_id=f"eval{run}.{p.prompt_id}-{j}", group_id=f"eval{run}.{p.prompt_id}",
                              prompt_ids=list(p.prompt_ids), meta={"prompt_id": p.prompt_id, "answer": p.answer,
                                                                   "row": p.row})
            await self.workflow.run(traj, generate_for(traj))
            traj.finish_reason = traj.finish_reason or "stop"
            if traj.reward is None:  # an agent may give its episode's reward itself, as in training
                out = await self.scorer.score(traj)
                traj.reward, traj.reward_failed = out.reward, out.failed
            else:  # a failed agent episode keeps its 0; it and a NaN or inf reward count as failed
                traj.reward_failed = bool(traj.meta.get("agent_error")) or not math.isfinite(traj.reward)
            return traj

        # a failing sample fails the evaluation: it stops every other sample at once (they hold engine slots)
        groups = await gather_or_cancel(*(gather_or_cancel(*(one(p, j) for j in range(self.n_samples)))
                                          for p in self.prompts))
        k = self.n_samples
        rewards = [t.reward if math.isfinite(t.reward) else 0.0 for g in groups for t in g]
        passed = [sum(t.reward >= self.pass_threshold for t in g) for g in groups]
        versions = [v for g in groups for t in g for v in t.policy_versions()]
        lens = [t.n_policy_tokens for g in groups for t in g]
        return {
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/pass@1": sum(c / k for c in passed) / len(groups),
            "eval/pass@k": sum(pass_at_k(k, c, k) for c in passed) / len(groups),
            "eval/k": k,
            "eval/n_prompts": len(groups),
            "eval/n_reward_failed": sum(t.reward_failed for g in groups for t in g),
            "eval/response_len_mean": sum(lens) / len(lens),
            "eval/version_min": min(versions, default=-1),
            "eval/version_max": max(versions, default=-1),
            "eval/s": time.perf_counter() - t0,
        }


class EvaluationSchedule:
    """When the controller evaluates (every ``eval.every`` steps, never blocking training, one at a time: one
    due while another runs is skipped and counted in ``eval/n_skipped``; and once at the end): a collaborator of
    :class:`megarl.loop.controller.Controller` (its ``evaluations``) kept with evaluation. It is given the config's
    ``eval`` section, the ``evaluator`` and ``on_eval``, the ``generation`` its samples go through, ``publish``
    (the final weights), the ``trainer`` and the engines' ``published`` version, and the step at each call; it
    owns the evaluations still running (``tasks``)."""

    def __init__(self, eval_cfg, evaluator: Evaluator | None, on_eval: Callable[[dict], None] | None, *,
                 generation, publish: Callable[[int], Awaitable[Any]], trainer, published) -> None:
        self.eval_cfg = eval_cfg
        self.evaluator = evaluator
        self.on_eval = on_eval
        self.generation = generation
        self.publish = publish
        self.trainer = trainer
        self.published = published
        self.tasks: set[asyncio.Task] = set()

    def generate_for_eval(self, traj: Trajectory):
        # as in training, an agent's client may write a completion into a part of its episode (into=row)
        return lambda ctx, sp, into=None: self.generation.generate(into or traj, ctx, sp, counted=False)

    async def evaluate(self, step: int) -> None:
        version = self.published.value
        try:
            metrics = await self.evaluator.run(self.generate_for_eval)
        except asyncio.CancelledError:
            raise
        except Exception:  # an evaluation must never take training down with it
            log.exception("evaluation at step %d failed", step)
            return
        record = {"step": step, "eval/start_version": version, **metrics, "eval/n_skipped": self.evaluator.n_skipped}
        log.info("eval at step %d: reward %.4f, pass@1 %.4f, pass@%d %.4f", step, metrics["eval/reward_mean"],
                 metrics["eval/pass@1"], metrics["eval/k"], metrics["eval/pass@k"])
        if self.on_eval is not None:
            self.on_eval(record)

    def maybe_evaluate(self, step: int, total_steps: int) -> None:
        every = self.eval_cfg.every
        if self.evaluator is None or every <= 0 or step % every or step >= total_steps:
            return
        if self.tasks:  # the last one takes longer than eval.every steps: one at a time, never a pile-up
            self.evaluator.n_skipped += 1
            log.warning("step %d: evaluation skipped, the one before is still running (%d skipped; raise eval.every)",
                        step, self.evaluator.n_skipped)
            return
        task = asyncio.create_task(self.evaluate(step))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def final_evaluation(self, step: int) -> None:
        """Wait for evaluations still running, then evaluate the final weights once."""
        if self.evaluator is None:
            return
        await asyncio.gather(*list(self.tasks))
        if self.trainer.version > self.published.value:  # the last step is not published for training: publish it now
            await self.publish(self.trainer.version)
        await self.evaluate(step)

    async def cancel(self) -> None:
        """Cancel the evaluations still running and wait for them (the loop's end)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
