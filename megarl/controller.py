"""The fully asynchronous RL loop.

::

      PromptDataset ──► rollout loop ──(gate: accepted + running + n <= (eta+v+1)·B)──┐
                            │                                                        │
                            ▼                                                        │
               workflow.run(traj, generate) ──► EngineRouter ──► engines (vLLM | HF) │
                 │   ▲            aborted by a publish: resubmit prompt+partial,     │
                 │   └──────────── continue with the new weights (tokens tagged v_t) │
                 ▼                                                                   │
          RewardService (worker processes) ──► advantages per group ──► ReplayBuffer ┘
                                                                             │ B oldest
                                                                             ▼
      recovery.anchor(batch) ──► trainer.train_step(policy_loss) ──► recovery.after_optimizer_step
                                                                             │
      publish v+1: abort in-flight ─► recovery.on_rollout_interrupted / before_publish
                   ─► engines load weights (disk | broadcast) ─► recovery.on_weights_published ─► resume

Generation never waits for training and training never waits for generation
beyond the staleness gate: the train step runs in a worker thread while the
event loop keeps feeding the engines. A recovery strategy sees only the hooks
(recovery/base.py); it never edits this loop.

Nothing lost: every ``logging.save_every`` steps and at the end the
``checkpointer`` (megarl/checkpoint.py) writes the loop's :meth:`state_dict`
with the trainer's and strategy's; :meth:`load_state_dict` continues from it
(running groups are regenerated from their prompts). A request whose engine
died (``EngineLost``, megarl/rollout/supervisor.py) is sent again, prompt +
partial, once an engine is up. A step the trainer skipped (non-finite loss or
gradient norm) is logged with its reason and not published, and its batch
stops counting against the staleness gate (``ReplayBuffer.release``); after
``trainer.max_consecutive_skips`` in a row the run checkpoints and stops. So
does a trainer that waited ``trainer.stall_timeout_s`` for a batch while no
trajectory was accepted, naming the gate's numbers.
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import replace
from typing import Any, Callable

from megarl.buffer import Group, PublishedVersion, ReplayBuffer
from megarl.data import Prompt
from megarl.errors import RewardError, TrainingError
from megarl.rollout.base import RouterProtocol
from megarl.rollout.supervisor import EngineLost
from megarl.trainer.base import TrainerProtocol
from megarl.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch, Trajectory, training_rows

log = logging.getLogger("megarl.controller")


class Controller:
    """Runs rollouts and training concurrently until ``total_steps`` optimizer steps are done.

    Collaborators are passed in, already built: ``trainer`` (TrainerProtocol:
    MegatronTrainer, or DrivingTrainer with several ranks), ``router``
    (RouterProtocol: EngineSupervisor over the engine processes), ``buffer``
    (the ReplayBuffer and staleness gate) and ``published`` (the engines'
    version, which this loop advances), ``rewards``
    (TrajectoryScorer: decodes with the run's tokenizer and scores in the
    reward service), ``dataset`` (PromptDataset), ``workflow``, ``strategy``
    (recovery), ``publisher(version) -> awaitable`` that moves the trainer's
    weights to every engine, ``loss_fn_factory(batch) -> loss_fn`` and
    ``on_step(record)`` for logging. Optional: ``checkpointer`` (``await
    checkpointer.save(controller)``), ``journal`` (``journal.write(name,
    record)``: accepted and trained trajectory ids per group and step, and
    samples decoded with ``tokenizer``) and ``evaluator`` (megarl/evaluation.py,
    results to ``on_eval``).
    """

    def __init__(self, cfg, *, trainer: TrainerProtocol, router: RouterProtocol, buffer: ReplayBuffer,
                 published: PublishedVersion, rewards, dataset, workflow, strategy, publisher: Any,
                 loss_fn_factory: Callable[[TrainBatch, Any], Any],
                 advantages: Callable[[list[Trajectory]], None], on_step: Callable[[dict], None],
                 checkpointer=None, journal=None, evaluator=None,
                 on_eval: Callable[[dict], None] | None = None, tokenizer=None) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.router = router
        self.rewards = rewards
        self.evaluator = evaluator
        self.on_eval = on_eval
        self.tokenizer = tokenizer
        self._evals: set[asyncio.Task] = set()
        self.dataset = dataset
        self.workflow = workflow
        self.strategy = strategy
        self.publisher = publisher
        self.loss_fn_factory = loss_fn_factory
        self.advantages = advantages
        self.on_step = on_step
        self.checkpointer = checkpointer
        self.journal = journal
        self.B = cfg.trainer.batch_size
        self.n = cfg.rollout.group_size
        self.eta = cfg.rollout.eta
        self.buffer = buffer
        self.published = published
        self.step = 0
        self.weights_ready = asyncio.Event()
        self.weights_ready.set()
        self._slots = asyncio.Semaphore(cfg.rollout.max_concurrency)
        self.inflight: dict[str, Trajectory] = {}  # request id -> trajectory being generated
        self.n_requests_inflight = 0
        self._all_returned = asyncio.Event()
        self._all_returned.set()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self.counters = {"n_interrupted": 0, "n_reward_calls": 0, "n_reward_failed": 0, "n_dropped": 0,
                         "n_filtered": 0, "n_engine_resubmits": 0}
        self._reward_failure: str | None = None  # one failing reward call of the current step, for the error
        self._fatal: Exception | None = None  # stops the rollout loop (and with it the run) when set
        self._failed_groups_in_a_row = 0
        self._prev_workflow_stats: dict[str, int] = {}
        self._step_counters = dict(self.counters)
        self._prev_step_counters = dict(self.counters)
        self.gen_stall_s = 0.0
        #: groups admitted so far; trajectory ids are {id_prefix}g{k}-{j}. A resumed attempt gets its own
        #: prefix, so groups a killed attempt admitted after its last checkpoint never share an id with new ones
        self.group_counter = 0
        self.id_prefix = ""
        self._items: dict[str, Any] = {}  # group id -> its prompt, while the group runs
        self._regenerate: list[Any] = []  # prompts of groups that were running at the checkpoint
        self._resumed = False
        self._consecutive_skips = 0

    @property
    def version(self) -> int:
        """The version the engines generate with."""
        return self.published.value

    @version.setter
    def version(self, value: int) -> None:
        self.published.value = value

    # -- generation ------------------------------------------------------------------
    async def _generate(self, traj: Trajectory, context_ids: list[int], sampling: SamplingParams,
                        counted: bool = True) -> GenerateResult:
        """One policy turn; survives interruption by resubmitting prompt + partial tokens.

        Policy tokens are appended to ``traj`` as they arrive (partial chunks
        too), so recovery hooks always see every token with its version. The
        returned result holds the whole turn. ``counted=False`` (evaluation)
        keeps the request out of the training counters.
        """
        out_ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        remaining = sampling.max_new_tokens
        chunk = 0
        while True:
            await self.weights_ready.wait()
            await self._slots.acquire()  # at most rollout.max_concurrency requests in flight
            if not self.weights_ready.is_set():  # a publish began while this request waited for a slot
                self._slots.release()
                continue
            rid = f"{traj.traj_id}/{len(traj.response_ids)}/{chunk}"
            # a distinct, reproducible seed per trajectory and resubmission
            seed = (self.cfg.trainer.seed * 1_000_003 + zlib.crc32(rid.encode())) % (2**31)
            req = GenerateRequest(rid, context_ids + out_ids, replace(sampling, max_new_tokens=remaining, seed=seed))
            self.inflight[rid] = traj
            self.n_requests_inflight += 1
            self._all_returned.clear()
            try:
                res = await self.router.generate(req)
            except EngineLost:
                res = None
            finally:
                self._slots.release()
                self.inflight.pop(rid, None)
                self.n_requests_inflight -= 1
                if self.n_requests_inflight == 0:
                    self._all_returned.set()
            if res is None:  # its engine died and took this chunk with it: send it again once one is up
                self.counters["n_engine_resubmits"] += counted
                await self.router.wait_available()
                continue
            traj.append_policy(res.output_ids, res.logp_behav, res.versions)
            out_ids += res.output_ids
            logps += res.logp_behav
            versions += res.versions
            remaining -= len(res.output_ids)
            chunk += 1
            if res.finish_reason != "abort":
                return GenerateResult(traj.traj_id, out_ids, logps, versions, res.finish_reason)
            traj.n_interrupts += 1
            self.counters["n_interrupted"] += counted
            if remaining <= 0:
                return GenerateResult(traj.traj_id, out_ids, logps, versions, "length")

    async def _run_group(self, group: Group, item) -> None:
        async def one(traj: Trajectory) -> Trajectory:
            # generate(context, sampling, into=row): an agent's episode may write into a part of its own
            await self.workflow.run(traj, lambda ctx, sp, into=None: self._generate(into or traj, ctx, sp))
            traj.finish_reason = traj.finish_reason or "stop"
            for row in traj.rows():  # a workflow sets finish_reason per turn; only its return ends the trajectory
                row.finished = True
                self.strategy.on_segment_finished(row)
            failure = traj.meta.get("agent_error")  # an agent that failed got reward 0 from its workflow
            if traj.reward is None:  # an agent may return the episode's reward itself
                out = await self.rewards.score(traj)
                traj.reward, traj.reward_failed = out.reward, out.failed
                failure = out.reason if out.failed else None
            # one outcome per episode (scored, or given by its agent), counted with its failure at once, so that a
            # step's share of failed calls never counts calls whose failures are not in yet; a failed agent counts
            # against reward.max_fail_frac like a failed reward
            self.counters["n_reward_calls"] += 1
            self.counters["n_reward_failed"] += failure is not None
            if failure is not None and self._reward_failure is None:
                self._reward_failure = f"trajectory {traj.traj_id}: {failure}"
            return traj

        try:
            trajs = await asyncio.gather(*(one(t) for t in group.trajectories))
        except Exception as e:
            log.exception("group %s failed; its samples are dropped", group.group_id)
            self.counters["n_dropped"] += len(group.trajectories)
            self._items.pop(group.group_id, None)
            self._failed_groups_in_a_row += 1
            if self._failed_groups_in_a_row >= max(2, self.B // self.n) and self._fatal is None:
                # a batch's worth of groups failed and nothing else finished: the next ones would too
                self._fatal = TrainingError(f"{self._failed_groups_in_a_row} groups in a row failed in generation; "
                                            f"the last with {type(e).__name__}: {e}")
            await self.buffer.accept(group, [])
            return
        self._failed_groups_in_a_row = 0
        failed = [t for t in trajs if t.reward_failed]
        kept = trajs
        if failed and self.cfg.reward.on_failure == "drop":
            kept = [t for t in trajs if not t.reward_failed]
            self.counters["n_dropped"] += len(failed)
        if kept and self.cfg.rollout.filter_groups and len(kept) == len(trajs) and self._all_equal(kept):
            # zero advantage everywhere: no learning signal. Leaving the gate's count lets another group in
            self.counters["n_filtered"] += len(kept)
            kept = []
        if kept:
            try:
                self.advantages(kept)
            except Exception:  # e.g. non-finite rewards: the group must still leave the gate's count
                log.exception("advantages of group %s failed; its samples are dropped", group.group_id)
                self.counters["n_dropped"] += len(kept)
                kept = []
        for t in kept:  # an episode's parts share its reward and advantage
            for part in t.parts:
                part.reward, part.advantage = t.reward, t.advantage
        self._items.pop(group.group_id, None)
        if self._fatal is None:  # with on_failure=drop nothing reaches a step: check here too, per B calls
            self._fatal = self._reward_failure_error(min_calls=self.B)
        accepted_total = await self.buffer.accept(group, kept)
        if kept and self.journal is not None:
            self.journal.write("accepted", {"step": self.step, "accepted_total": accepted_total,
                                            "group_id": group.group_id, "traj_ids": [t.traj_id for t in kept]})

    @staticmethod
    def _all_equal(trajs: list[Trajectory]) -> bool:
        rewards = [t.reward for t in trajs]
        return max(rewards) - min(rewards) <= 1e-9

    async def _rollout_loop(self) -> None:
        data = iter(self.dataset)
        while not self._stopping:
            if self.router.failure is not None:  # every engine is gone for good
                raise self.router.failure
            if self._fatal is not None:
                raise self._fatal
            if not await self.buffer.wait_admissible(self.n, lambda: self.version, ready=self.weights_ready.is_set,
                                                     stop=lambda: self._stopping or self._fatal is not None):
                if self._fatal is not None:
                    raise self._fatal
                return
            if self._fatal is not None:
                raise self._fatal
            item = self._regenerate.pop(0) if self._regenerate else next(data)
            gid = f"{self.id_prefix}g{self.group_counter}"
            trajs = [Trajectory(traj_id=f"{gid}-{j}", group_id=gid, prompt_ids=list(item.prompt_ids),
                                meta={"prompt_id": item.prompt_id, "answer": item.answer, "row": item.row},
                                logp_old=[] if self.strategy.exact else None)
                     for j in range(self.n)]
            group = Group(gid, self.version, trajs)
            self.buffer.admit(group)
            self._items[gid] = item
            self.group_counter += 1
            task = asyncio.create_task(self._run_group(group, item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- publishing ----------------------------------------------------------------
    async def publish(self, new_version: int) -> dict[str, float]:
        """Move the trainer's weights to the engines as ``new_version``.

        The export runs before generation stops; only aborting, the strategy's
        publish hooks and loading into the engines stall generation.
        """
        t_prep = time.perf_counter()
        await self.publisher.prepare(new_version)
        t0 = time.perf_counter()
        self.weights_ready.clear()
        old = self.version
        if self.cfg.rollout.interruptible:
            await self.router.abort_all()
        await self._all_returned.wait()  # aborted requests return their partial tokens
        t_stopped = time.perf_counter()
        partials = [r for g in self.buffer.running_groups.values() for t in g.trajectories for r in t.rows()
                    if r.response_ids and not r.finished]
        self.strategy.on_rollout_interrupted(partials)
        self.strategy.before_publish(old, new_version)
        t_sync = time.perf_counter()
        synced = await self.publisher.apply(new_version)  # the publisher's own numbers (bytes, ...) or None
        t_loaded = time.perf_counter()
        self.version = new_version
        self.strategy.on_weights_published(new_version)
        self.weights_ready.set()
        await self.buffer.notify()
        t1 = time.perf_counter()
        self.gen_stall_s += t1 - t0
        return {"publish_s": t1 - t_prep, "weight_export_s": t0 - t_prep, "publish_stall_s": t1 - t0,
                "publish_drain_s": t_stopped - t0, "publish_recovery_s": t_sync - t_stopped,
                "weight_sync_s": t_loaded - t_sync, **(synced or {})}

    # -- training ------------------------------------------------------------------
    async def _next_batch(self, roll: asyncio.Task) -> list[Trajectory]:
        """The next batch; if the rollout loop dies instead, its error (no waiting forever for data).

        A wait of ``trainer.stall_timeout_s`` without any trajectory accepted is a stall (nothing that
        runs can complete a batch, or nothing runs): checkpoint, then stop naming the gate's numbers.
        """
        get = asyncio.ensure_future(self.buffer.get_batch(self.trainer.version, self.version))
        timeout = self.cfg.trainer.stall_timeout_s
        accepted = self.buffer.accepted_total
        while True:
            done, _ = await asyncio.wait({get, roll}, timeout=timeout or None, return_when=asyncio.FIRST_COMPLETED)
            if done:
                break
            if self.buffer.accepted_total != accepted:  # trajectories still arrive: slow, not stalled
                accepted = self.buffer.accepted_total
                continue
            get.cancel()
            await self._checkpoint()
            raise TrainingError(self._stall_message(timeout))
        if not get.done():
            get.cancel()
            roll.result()  # raises the rollout loop's error
            raise RuntimeError("the rollout loop stopped")
        return get.result()

    def _stall_message(self, timeout: float) -> str:
        g = self.buffer.gate_state(self.version)
        return (f"no batch for step {self.step}: the trainer waited {timeout:.1f} s (trainer.stall_timeout_s) and no "
                f"trajectory was accepted meanwhile. Staleness gate: accepted {g['accepted']} + running "
                f"{g['running']} of capacity {g['capacity']} = (rollout.eta {self.eta} + version {self.version} + 1) "
                f"x trainer.batch_size {self.B} (released by skipped steps {g['released']}); ready {g['ready']} of "
                f"{self.B}; trainer version {self.trainer.version}; dropped {self.counters['n_dropped']}. A checkpoint "
                f"of this step is in the run directory. A full gate with nothing running means no batch can ever "
                f"form (check rollout.eta and trainer.publish_every); otherwise the engines or the rewards are stuck "
                f"(for very long generations raise trainer.stall_timeout_s), then resume with --resume")

    async def _checkpoint(self) -> None:
        if self.checkpointer is not None and self.checkpointer.last_step != self.step:
            t0 = time.perf_counter()
            await self.checkpointer.save(self)
            log.info("step %d: checkpoint in %.2f s", self.step, time.perf_counter() - t0)

    async def train(self, total_steps: int) -> None:
        if not self._resumed:  # a resumed strategy's state already holds the engines' version
            self.strategy.on_weights_published(self.version)
        elif (self.trainer.version > self.version and self.trainer.version % self.cfg.trainer.publish_every == 0
              and self.step < total_steps):
            # the checkpointed run ended before publishing its last step; the gate needs that version
            await self.publish(self.trainer.version)
        roll = asyncio.create_task(self._rollout_loop())
        t_start = time.perf_counter()
        save_every = self.cfg.logging.save_every
        max_skips = self.cfg.trainer.max_consecutive_skips
        try:
            while self.step < total_steps:
                t0 = time.perf_counter()
                trajs = await self._next_batch(roll)
                t_got = time.perf_counter()
                trajs = training_rows(trajs)  # an agent's episode may hold several rows
                record = await asyncio.to_thread(self._train_on, trajs)
                t_trained = time.perf_counter()
                skipped = bool(record.get("skipped"))
                if skipped:  # no optimizer step happened: nothing for the hooks, nothing to publish
                    self._consecutive_skips += 1
                    self.buffer.release(len(trajs))  # consumed without a step: the gate must not count them
                    record["skip_reason"] = self.trainer.last_skip_reason or "skipped"
                else:
                    self._consecutive_skips = 0
                    # in a worker thread: strategies may run forwards here while the engines keep generating
                    await asyncio.to_thread(self.strategy.after_optimizer_step, self.trainer.version, record)
                record["consecutive_skips"] = self._consecutive_skips
                record["after_step_hooks_s"] = time.perf_counter() - t_trained
                pub: dict[str, float] = {}
                if (not skipped and self.trainer.version > self.version
                        and self.trainer.version % self.cfg.trainer.publish_every == 0
                        and self.step + 1 < total_steps):
                    pub = await self.publish(self.trainer.version)
                self.step += 1
                record.update(pub)
                record.update(self._step_record(trajs, t0, t_got, t_trained, t_start))
                reward_error = self._reward_failure_error(min_calls=1, since=self._prev_step_counters)
                self._reward_failure = None
                self.on_step(record)
                self._log_samples(trajs)
                if self.journal is not None:
                    self.journal.write("trained_ids", {"step": self.step, "version": self.trainer.version,
                                                       "skipped": skipped, "traj_ids": [t.traj_id for t in trajs]})
                await self.buffer.notify()
                if max_skips > 0 and self._consecutive_skips >= max_skips:
                    await self._checkpoint()
                    raise TrainingError(
                        f"{self._consecutive_skips} consecutive steps skipped (last: {record['skip_reason']}, step "
                        f"{self.step}, version {self.trainer.version}); stopping (trainer.max_consecutive_skips="
                        f"{max_skips}). A checkpoint of this step is in the run directory: lower trainer.lr or check "
                        f"the rewards, then resume with --resume")
                if reward_error is not None:
                    await self._checkpoint()
                    raise reward_error
                if save_every > 0 and self.step % save_every == 0:
                    await self._checkpoint()
                self._maybe_evaluate(total_steps)
            await self._checkpoint()
            await self._final_evaluation()
        finally:
            self._stopping = True
            for task in list(self._evals):
                task.cancel()
            await asyncio.gather(*self._evals, return_exceptions=True)
            await self.buffer.notify()
            self.weights_ready.set()
            await self.router.abort_all()
            await asyncio.gather(roll, return_exceptions=True)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _train_on(self, trajs: list[Trajectory]) -> dict[str, Any]:
        batch = TrainBatch.from_trajectories(trajs, version=self.trainer.version)
        t0 = time.perf_counter()
        anchor = self.strategy.anchor(batch, trajs)
        t_anchor = time.perf_counter()
        if anchor.logp_anchor is not None:
            batch.logp_anchor = anchor.logp_anchor
        metrics = self.trainer.train_step(batch, self.loss_fn_factory(batch, anchor))
        t_step = time.perf_counter()
        metrics = dict(metrics)
        metrics.update(anchor.metrics)
        metrics["anchor_exact"] = float(anchor.exact)
        metrics["recovery_s"] = t_anchor - t0
        metrics["train_step_s"] = t_step - t_anchor
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

    def _reward_failure_error(self, min_calls: int, since: dict[str, int] | None = None) -> RewardError | None:
        """The error to stop with when more than reward.max_fail_frac of the reward calls since ``since``
        (default: the last step) failed, if there were at least ``min_calls`` of them."""
        since = self._step_counters if since is None else since
        calls = self.counters["n_reward_calls"] - since["n_reward_calls"]
        failed = self.counters["n_reward_failed"] - since["n_reward_failed"]
        frac = self.cfg.reward.max_fail_frac
        if calls < max(min_calls, 1) or failed <= frac * calls:
            return None
        return RewardError(f"{failed} of {calls} reward calls failed at step {self.step} (more than "
                           f"reward.max_fail_frac={frac}) with reward.fn={self.cfg.reward.fn!r}; one of them: "
                           f"{self._reward_failure}. Fix the reward function or the data (data.answer_key), "
                           f"or raise reward.max_fail_frac")

    def _log_samples(self, trajs: list[Trajectory]) -> None:
        """``logging.log_samples`` trajectories of the step as decoded text, to ``samples.jsonl``."""
        n = self.cfg.logging.log_samples
        if n <= 0 or self.journal is None or self.tokenizer is None:
            return
        tok = self.tokenizer
        for t in trajs[:n]:
            self.journal.write("samples", {
                "step": self.step, "traj_id": t.traj_id, "prompt": tok.decode_prompt(t.prompt_ids),
                "response": tok.decode_response(t.response_ids), "reward": t.reward,
                "answer": t.meta.get("answer"), "finish_reason": t.finish_reason,
                # [version, number of tokens] per segment, in order: which weights wrote which part
                "versions": [[g.version, g.end - g.start] for g in t.segments()]})

    # -- evaluation ----------------------------------------------------------------------
    def _generate_for_eval(self, traj: Trajectory):
        return lambda ctx, sp: self._generate(traj, ctx, sp, counted=False)

    async def _evaluate(self, step: int) -> None:
        version = self.version
        try:
            metrics = await self.evaluator.run(self._generate_for_eval)
        except asyncio.CancelledError:
            raise
        except Exception:  # an evaluation must never take training down with it
            log.exception("evaluation at step %d failed", step)
            return
        record = {"step": step, "eval/start_version": version, **metrics}
        log.info("eval at step %d: reward %.4f, pass@1 %.4f, pass@%d %.4f", step, metrics["eval/reward_mean"],
                 metrics["eval/pass@1"], metrics["eval/k"], metrics["eval/pass@k"])
        if self.on_eval is not None:
            self.on_eval(record)

    def _maybe_evaluate(self, total_steps: int) -> None:
        every = self.cfg.eval.every
        if self.evaluator is None or every <= 0 or self.step % every or self.step >= total_steps:
            return
        task = asyncio.create_task(self._evaluate(self.step))
        self._evals.add(task)
        task.add_done_callback(self._evals.discard)

    async def _final_evaluation(self) -> None:
        """Wait for evaluations still running, then evaluate the final weights once."""
        if self.evaluator is None:
            return
        await asyncio.gather(*list(self._evals))
        if self.trainer.version > self.version:  # the last step is not published for training: publish it now
            await self.publish(self.trainer.version)
        await self._evaluate(self.step)

    def _workflow_step_stats(self) -> dict[str, int]:
        """What the workflow counted (agent turns, tool calls, failures) since the last step."""
        now = self.workflow.stats()
        step = {k: v - self._prev_workflow_stats.get(k, 0) for k, v in now.items()}
        self._prev_workflow_stats = now
        return step

    def _step_record(self, trajs, t0, t_got, t_trained, t_start) -> dict[str, Any]:
        rewards = [t.reward for t in trajs if t.reward is not None]
        step_counts = {k: self.counters[k] - self._step_counters[k] for k in self.counters}
        self._prev_step_counters = self._step_counters
        self._step_counters = dict(self.counters)
        resp_lens = [t.n_policy_tokens for t in trajs]
        return {
            "step": self.step,
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
            "gen_stall_total_s": self.gen_stall_s,
            **step_counts,
            **self._workflow_step_stats(),
            **self.router.stats(),
            **{f"recovery/{k}": v for k, v in self.strategy.overhead().items()},
        }

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loop's part of a checkpoint; call it on the event loop (a consistent cut).

        The buffer's accepted-but-untrained trajectories keep their per-token
        versions, logp_behav and any recovered logp_old; groups still running
        contribute only their prompts, which :meth:`load_state_dict` generates again.
        """
        running = sorted(self.buffer.running_groups.values(), key=lambda g: g.seq)
        prompts = self._regenerate + [self._items[g.group_id] for g in running if g.group_id in self._items]
        return {"step": self.step, "version": self.version, "group_counter": self.group_counter,
                "counters": dict(self.counters), "gen_stall_s": self.gen_stall_s,
                "buffer": self.buffer.state_dict(), "dataset": self.dataset.state_dict(),
                "running_prompts": [p.to_dict() for p in prompts]}

    def load_state_dict(self, state: dict[str, Any], id_prefix: str = "") -> None:
        """Continue from :meth:`state_dict`: before :meth:`train`, after the trainer and strategy are restored.

        ``id_prefix`` starts the ids of the groups this attempt admits (unique per attempt, e.g. ``r1.``).
        """
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.group_counter = int(state["group_counter"])
        self.counters.update(state["counters"])
        self._step_counters = dict(self.counters)
        self._prev_step_counters = dict(self.counters)
        self.gen_stall_s = float(state.get("gen_stall_s", 0.0))
        self.buffer.load_state_dict(state["buffer"])
        self.dataset.load_state_dict(state["dataset"])
        self._regenerate = [Prompt.from_dict(d) for d in state["running_prompts"]]
        self.id_prefix = id_prefix
        self._resumed = True
