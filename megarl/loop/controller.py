"""The fully asynchronous RL loop::

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
event loop keeps feeding the engines through InterruptibleGeneration
(megarl/rollout/interruptible.py), which a publish closes, drains and opens.
A recovery strategy sees only the hooks (recovery/base.py); it never edits
this loop.

Nothing lost: every ``logging.save_every`` steps or ``logging.save_every_s``
seconds, at the end, on SIGTERM/SIGINT and before an error stops the loop
(megarl/loop/run_stop.py) the ``checkpointer`` (megarl/checkpoint/run_checkpoint.py) writes the
loop's :meth:`state_dict` with the trainer's and strategy's; :meth:`load_state_dict` continues from it
(running groups kept whole and continued, megarl/loop/running_groups.py). A request whose engine
died (``EngineLost``, megarl/rollout/supervisor.py) is sent again, prompt +
partial, once an engine is up. A step the trainer skipped (non-finite loss or
gradient norm) is logged with its reason and not published, and its batch
stops counting against the staleness gate (``ReplayBuffer.release``); after
``trainer.max_consecutive_skips`` in a row the run checkpoints and stops. So
does a trainer that waited ``trainer.stall_timeout_s`` for a batch while no
trajectory was accepted, naming the gate's numbers.

The controller keeps the step, the engines' version, the counters and the
window of failed episodes, and draws the loop above; its parts are
collaborators it builds and calls, each given what it reads: ``running``
(RunningGroups, megarl/loop/running_groups.py: each admitted group from its
episodes to the buffer, the groups' prompts, turn points and tasks, and the
running groups in a checkpoint), ``bookkeeping`` (StepBookkeeping,
megarl/loop/step_record.py: the train step, the step record and its counters'
boundary, samples, the stall message), ``stops`` (RunStops,
megarl/loop/run_stop.py: the wait for a batch, stop requests, the save clock),
``checkpoints`` (CheckpointSchedule, megarl/checkpoint/schedule.py: a save, and
the periodic ones failed in a row) and ``evaluations`` (EvaluationSchedule,
megarl/loop/evaluation.py: when to evaluate, the evaluations running).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from megarl.checkpoint.schedule import CheckpointSchedule
from megarl.data import prompt_stream
from megarl.failure_causes import FailureWindow
from megarl.loop.buffer import Group, PublishedVersion, ReplayBuffer
from megarl.loop.evaluation import EvaluationSchedule
from megarl.loop.run_stop import RunStops
from megarl.loop.running_groups import RESUME_COUNTERS, RunningGroups, fresh_trajectory
from megarl.loop.step_record import StepBookkeeping
from megarl.rollout.base import RouterProtocol
from megarl.rollout.interruptible import InterruptibleGeneration
from megarl.trainer.base import TrainerProtocol
from megarl.types import TrainBatch, Trajectory, training_rows

log = logging.getLogger("megarl.loop.controller")


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
    samples decoded with ``tokenizer``) and ``evaluator`` (megarl/loop/evaluation.py,
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
        self.dataset = dataset
        self.workflow = workflow
        self.strategy = strategy
        self.publisher = publisher
        self.on_step = on_step
        self.B = cfg.trainer.batch_size
        self.n = cfg.rollout.group_size
        self.eta = cfg.rollout.eta
        self.buffer = buffer
        self.published = published
        self.step = 0
        self._stopping = False
        # the generation adds the counters it keeps (megarl/rollout/interruptible.py COUNTERS)
        self.counters = {"n_reward_calls": 0, "n_reward_failed": 0, "n_dropped": 0, "n_filtered": 0,
                         **dict.fromkeys(RESUME_COUNTERS, 0)}
        self.generation = InterruptibleGeneration(router, cfg.rollout, seed=cfg.trainer.seed, counters=self.counters)
        self.generation.may_hold = self._may_hold
        #: why each of the last B episode outcomes failed, if it did (what reward.max_fail_frac is checked on)
        self.failures = FailureWindow(self.B)
        self.gen_stall_s = 0.0
        #: groups admitted so far; trajectory ids are {id_prefix}g{k}-{j}. A resumed attempt gets its own
        #: prefix, so groups a killed attempt admitted after its last checkpoint never share an id with new ones
        self.group_counter = 0
        self.id_prefix = ""
        self._resumed = False
        self._consecutive_skips = 0
        # the collaborators (module doc); the bookkeeping's counter boundary starts from the generation's counters
        self.bookkeeping = StepBookkeeping(
            cfg, trainer=trainer, strategy=strategy, loss_fn_factory=loss_fn_factory, router=router,
            workflow=workflow, buffer=buffer, journal=journal, tokenizer=tokenizer, counters=self.counters,
            failures=self.failures, published=published)
        self.running = RunningGroups(
            cfg, buffer=buffer, workflow=workflow, generation=self.generation, router=router, strategy=strategy,
            rewards=rewards, advantages=advantages, journal=journal, counters=self.counters, failures=self.failures,
            step=lambda: self.step, failure_error=self.bookkeeping.failure_error)
        self.checkpoints = CheckpointSchedule(checkpointer, publisher, cfg.logging)
        self.stops = RunStops(cfg, trainer=trainer, buffer=buffer, published=published, checkpointer=checkpointer,
                              checkpoint=self._checkpoint, quiesce=self.running.quiesce_for_stop,
                              train_on=self.bookkeeping.train_on, stall_message=self.bookkeeping.stall_message)
        self.evaluations = EvaluationSchedule(cfg.eval, evaluator, on_eval, generation=self.generation,
                                              publish=self.publish, trainer=trainer, published=published)

    @property
    def version(self) -> int:
        """The version the engines generate with."""
        return self.published.value

    @version.setter
    def version(self, value: int) -> None:
        self.published.value = value

    @property
    def stop_requested(self) -> bool:
        return self.stops.stop_requested

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary (or at once while waiting for a batch); call it on the event loop."""
        self.stops.request_stop(reason)

    def _may_hold(self, traj: Trajectory) -> bool:
        """rollout.splice_at_tokens holds odd groups that can wait for the next publish: of the current version
        (no batch deadline waits on them) or due two versions later at the earliest; the even ones keep batches
        forming while they are held (megarl/loop/buffer.py). A trajectory already spliced is not held again."""
        group = self.buffer.running_groups.get(traj.group_id)
        return (group is not None and group.seq % 2 == 1 and set(traj.versions) <= {self.version}
                and (group.start_version == self.version or group.start_version + self.eta >= self.version + 2))

    async def _rollout_loop(self) -> None:
        next_prompt = prompt_stream(self.dataset)
        while not self._stopping:
            if self.router.failure is not None:  # every engine is gone for good
                raise self.router.failure
            if self.running.fatal is not None:
                raise self.running.fatal
            if not await self.buffer.wait_admissible(self.n, lambda: self.version, ready=self.generation.is_open,
                                                     stop=lambda: self._stopping or self.running.fatal is not None):
                if self.running.fatal is not None:
                    raise self.running.fatal
                return
            if self.running.fatal is not None:
                raise self.running.fatal
            if self.running.regenerate:
                item = self.running.regenerate.pop(0)
            else:
                item = await next_prompt()
                if not self.generation.is_open() or self._stopping:  # it waited for a row: a publish may have begun
                    self.running.regenerate.insert(0, item)
                    continue
            gid = f"{self.id_prefix}g{self.group_counter}"
            group = Group(gid, self.version, [fresh_trajectory(f"{gid}-{j}", gid, item, self.strategy.exact)
                                              for j in range(self.n)])
            self.buffer.admit(group)
            self.running.items[gid] = item
            self.group_counter += 1
            self.running.spawn(group, item)

    # -- publishing ----------------------------------------------------------------
    async def publish(self, new_version: int) -> dict[str, float]:
        """Move the trainer's weights to the engines as ``new_version``.

        The export runs before generation stops; only aborting, the strategy's
        publish hooks and loading into the engines stall generation.
        """
        t_prep = time.perf_counter()
        await self.publisher.prepare(new_version)
        t0 = time.perf_counter()
        self.generation.close()
        in_flight = self.generation.n_inflight  # what this publish finds mid-answer (0: the engines were idle)
        old = self.version
        if self.cfg.rollout.interruptible:
            await self.router.abort_all()
        await self.generation.drained(self.cfg.rollout.publish_timeout_s)  # aborted requests return their partials
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
        self.generation.open()
        await self.buffer.notify()
        t1 = time.perf_counter()
        self.gen_stall_s += t1 - t0
        return {"publish_s": t1 - t_prep, "weight_export_s": t0 - t_prep, "publish_stall_s": t1 - t0,
                "publish_drain_s": t_stopped - t0, "publish_recovery_s": t_sync - t_stopped,
                "weight_sync_s": t_loaded - t_sync, "n_publish_inflight": in_flight, **(synced or {})}

    # -- training ------------------------------------------------------------------

    async def train(self, total_steps: int) -> None:
        if not self._resumed:  # a resumed strategy's state already holds the engines' version
            self.strategy.on_weights_published(self.version)
        elif (self.trainer.version > self.version and self.trainer.version % self.cfg.trainer.publish_every == 0
              and self.step < total_steps):
            # the checkpointed run ended before publishing its last step; the gate needs that version
            await self.publish(self.trainer.version)
        self.running.start_restored()  # running groups a checkpoint kept go on first
        roll = asyncio.create_task(self._rollout_loop())
        t_start = time.perf_counter()
        max_skips = self.cfg.trainer.max_consecutive_skips
        try:
            while self.step < total_steps:
                t0 = time.perf_counter()
                episodes = await self.stops.next_batch(roll, self.step)  # what the gate counts
                t_got = time.perf_counter()
                trajs = training_rows(episodes)  # an agent's episode may hold several rows
                record = await self.stops.train_batch(trajs, episodes)
                t_trained = time.perf_counter()
                skipped = bool(record.get("skipped"))
                if skipped:  # no optimizer step happened: nothing for the hooks, nothing to publish
                    self._consecutive_skips += 1
                    self.buffer.release(len(episodes))  # consumed without a step: the gate stops counting them
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
                        and self.step + 1 < total_steps and not self.stop_requested):
                    pub = await self.publish(self.trainer.version)
                self.step += 1
                record.update(pub)
                record.update(self.bookkeeping.step_record(trajs, t0, t_got, t_trained, t_start, step=self.step,
                                                           gen_stall_s=self.gen_stall_s))
                failure_error = self.bookkeeping.failure_error(self.step)
                self.on_step(record)
                self.bookkeeping.log_samples(trajs, self.step)
                self.bookkeeping.journal_trained(trajs, skipped, self.step)
                await self.buffer.notify()
                if max_skips > 0 and self._consecutive_skips >= max_skips:
                    await self._checkpoint()
                    raise self.bookkeeping.skips_error(record["skip_reason"], max_skips,
                                                       consecutive=self._consecutive_skips, step=self.step)
                if failure_error is not None:
                    await self._checkpoint()
                    raise failure_error
                await self.stops.after_step(self.step)  # a stop request, or a checkpoint due (megarl/loop/run_stop.py)
                self.evaluations.maybe_evaluate(self.step, total_steps)
            await self._checkpoint()
            await self.evaluations.final_evaluation(self.step)
        finally:
            self._stopping = True
            await self.evaluations.cancel()
            await self.buffer.notify()
            self.generation.open()
            await self.router.abort_all()
            roll.cancel()  # it may wait for a prompt (rows an agent service posts)
            await asyncio.gather(roll, return_exceptions=True)
            await self.running.cancel()

    # -- checkpoints -------------------------------------------------------------------
    async def _checkpoint(self, periodic: bool = False) -> None:
        """Checkpoint the step reached (megarl/checkpoint/schedule.py; ``periodic``: one that may fail)."""
        await self.checkpoints.checkpoint(self, self.step, periodic)

    def state_dict(self) -> dict[str, Any]:
        """The loop's part of a checkpoint; call it on the event loop (a consistent cut).

        The buffer's accepted-but-untrained trajectories keep their per-token
        versions, logp_behav and any recovered logp_old; groups still running
        are kept whole, partial trajectories included (megarl/loop/running_groups.py).
        """
        return {"step": self.step, "version": self.version, "group_counter": self.group_counter,
                "counters": dict(self.counters), "step_counters": dict(self.bookkeeping.step_counters),
                "gen_stall_s": self.gen_stall_s,
                "buffer": self.buffer.state_dict(), "dataset": self.dataset.state_dict(),
                **self.running.state_dict(), **self.bookkeeping.loss_state()}

    def load_state_dict(self, state: dict[str, Any], id_prefix: str = "") -> None:
        """Continue from :meth:`state_dict`: before :meth:`train`, after the trainer and strategy are restored.

        ``id_prefix`` starts the ids of the groups this attempt admits (unique per attempt, e.g. ``r1.``).
        """
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.group_counter = int(state["group_counter"])
        self.counters.update(state["counters"])
        # counted after the last step record (a stop's aborted requests): the next record reports them
        self.bookkeeping.step_counters = {**self.counters, **state.get("step_counters", {})}
        self.gen_stall_s = float(state.get("gen_stall_s", 0.0))
        self.buffer.load_state_dict(state["buffer"])
        self.dataset.load_state_dict(state["dataset"])
        self.id_prefix = id_prefix
        self.running.restore(state, id_prefix)  # after the buffer: its gate counts them as running again
        self.bookkeeping.load_loss_state(state)
        self._resumed = True
