"""Running groups: each group the rollout loop admitted, from its episodes to the buffer, and across a checkpoint
what a stop keeps of the groups still generating and how a resume goes on.

A group runs its episodes at once (the workflow, then the reward unless its agent gave one); a failed episode
counts against ``reward.max_fail_frac``, a group that raised is dropped (a batch's worth of those in a row stop
the run), ``rollout.filter_groups`` drops one whose rewards are all equal, and the rest get their advantages and
go to the buffer (:meth:`RunningGroups.run_group`).

A checkpoint keeps every running group whole (:meth:`RunningGroups.state_dict`):

* trajectories whose workflow returned, with everything the buffer keeps for accepted ones (scored, or still
  waiting for their score);
* partial ones with their tokens so far, per-token versions, ``logp_behav``, any recovered ``logp_old`` and
  their routes, and where their workflow stands (:class:`TurnPoint`: the policy turn in progress, the response
  tokens before it, and whether its generation had returned).

The cut is the event loop's, so no token is both kept and generated again: a request in flight has given the
trajectory only the chunks that came back before it (an interruption's), and what the engine sampled since is
not kept, and is sampled again on resume. A stop first aborts every request and waits for its partial tokens
(:meth:`RunningGroups.quiesce_for_stop`), so that its checkpoint leaves out nothing that was sampled. A
trajectory keeps its turn until its workflow returned, also while a failed group stops its siblings before it
is dropped: a cut then keeps each of them with its turn, never tokens without one (which could not continue).

On resume (:meth:`RunningGroups.restore`) each group is admitted again with its start version (its
deadline), before any recovery hook can free a version its tokens reference (snapshot's kept versions, the
dedicated scorer's state and ewma's phi are in the same checkpoint). A trajectory that had finished waits for
its siblings, one whose score had not come is scored, and a partial one of a workflow that can continue
(``resumable``: megarl's single_turn and multi_turn) continues its turn as a splice: prompt + tokens so far
goes to the engine, which prefills it at the resumed weights; its old tokens keep their versions and
``logp_behav``, the new ones get the resumed version. An episode that cannot continue (an agent's: its state
lives in the agent function, its command's process or an external service, where it may have begun before its
first token) is generated again from its row under a new id (the dedicated scorer's results are keyed by id);
such a group with no finished trajectory starts again from its prompt as a new group. Step metrics count both:
``n_continued_after_resume`` (trajectories a resume kept, finished or partial), ``n_regenerated_after_resume``
(episodes started again) and ``n_tokens_regenerated_after_resume`` (the policy tokens those had).

:class:`RunningGroups` is a collaborator of :class:`megarl.loop.controller.Controller` (its ``running``), given the
run's ``cfg``, ``buffer``, ``workflow``, ``generation``, ``router``, ``strategy``, ``rewards``, ``advantages`` and
``journal``, the loop's ``counters`` and ``failures``, and ``step`` and ``failure_error`` to call; the resumed
attempt's ``id_prefix`` comes with :meth:`RunningGroups.restore`. It owns the running groups' prompts (``items``),
the prompts to generate again (``regenerate``), the groups a checkpoint kept (``restored``), the turn points
(``turns``), the groups' tasks (``tasks``) and the error that stops the rollout loop (``fatal``).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import math
from dataclasses import asdict
from typing import Any, Callable

from megarl.data import Prompt
from megarl.errors import TrainingError
from megarl.failure_causes import AGENT, AGENT_REWARD, REWARD, FailureWindow, generation_failure
from megarl.loop.buffer import Group
from megarl.loop.group_tasks import gather_or_cancel
from megarl.stop_protocol import stop_budget
from megarl.types import GenerateResult, SamplingParams, Trajectory
from megarl.workflows.base import TurnPoint

log = logging.getLogger("megarl.loop.controller")

#: seconds a stop waits for aborted requests to return their partial tokens: an engine answers an abort at once,
#: and a wedged one must not take the stop budget (what it holds is sampled again on resume)
STOP_DRAIN_S = 5.0
#: what a resume counts in the step metrics (module doc)
RESUME_COUNTERS = ("n_continued_after_resume", "n_regenerated_after_resume", "n_tokens_regenerated_after_resume")


def fresh_trajectory(traj_id: str, group_id: str, item: Prompt, exact: bool) -> Trajectory:
    """A trajectory of ``item`` with nothing generated yet (``logp_old`` kept when the strategy is exact)."""
    return Trajectory(traj_id=traj_id, group_id=group_id, prompt_ids=list(item.prompt_ids),
                      meta={"prompt_id": item.prompt_id, "answer": item.answer, "row": item.row},
                      logp_old=[] if exact else None)


class RunningGroups:
    """The controller's running groups: run, and in a checkpoint and on resume (module doc)."""

    def __init__(self, cfg, *, buffer, workflow, generation, router, strategy, rewards,
                 advantages: Callable[[list[Trajectory]], None], journal, counters: dict[str, int],
                 failures: FailureWindow, step: Callable[[], int],
                 failure_error: Callable[[int], TrainingError | None]) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.workflow = workflow
        self.generation = generation
        self.router = router
        self.strategy = strategy
        self.rewards = rewards
        self.advantages = advantages
        self.journal = journal
        self.counters = counters
        self.failures = failures
        self.step = step  # the loop's step now (what an accepted group is journaled with)
        self.failure_error = failure_error  # failure_error(step): the error when too many episodes failed
        self.B, self.n = cfg.trainer.batch_size, cfg.rollout.group_size
        self.fatal: Exception | None = None  # stops the rollout loop (and with it the run) when set
        self._failed_groups_in_a_row = 0
        self.items: dict[str, Prompt] = {}  # group id -> its prompt, while the group runs
        self.regenerate: list[Prompt] = []  # prompts a checkpoint took before their groups were admitted
        self.restored: list[Group] = []  # running groups a checkpoint kept, until train() starts them
        self.turns: dict[str, TurnPoint] = {}  # traj id -> its workflow's TurnPoint
        self.tasks: set[asyncio.Task] = set()

    async def run_group(self, group: Group, item: Prompt) -> None:
        """Run ``group``'s episodes, score them and hand the group to the buffer (module doc)."""
        async def one(traj: Trajectory) -> Trajectory:
            if traj.finished and traj.reward is not None:  # scored before a checkpoint: it waits for its siblings
                return traj
            if not traj.finished:  # (a finished one a checkpoint kept waits for its score)
                await self.run_workflow(traj)  # an agent's episode may write into parts of its own
                traj.finish_reason = traj.finish_reason or "stop"
                for row in traj.rows():  # a workflow sets finish_reason per turn; only its return ends it
                    row.finished = True
                    self.strategy.on_segment_finished(row)
            failure = traj.meta.get("agent_error")  # an agent that failed got reward 0 from its workflow
            cause = AGENT if failure is not None else None
            if traj.reward is None:  # an agent may return the episode's reward itself
                out = await self.rewards.score(traj)
                traj.reward, failure = out.reward, (out.reason or "failed") if out.failed else None
                cause = REWARD if out.failed else None
            elif failure is None and not math.isfinite(traj.reward):  # would poison its group's advantages
                failure, cause, traj.reward = f"the agent returned the reward {traj.reward}", AGENT_REWARD, 0.0
            traj.reward_failed = failure is not None  # a failed episode is a failed reward (reward.on_failure)
            # one outcome per episode (scored, or given by its agent), counted with its failure at once, so that a
            # step's share of failed calls never counts calls whose failures are not in yet; a failed agent counts
            # against reward.max_fail_frac like a failed reward
            self.counters["n_reward_calls"] += 1
            self.counters["n_reward_failed"] += failure is not None
            self.failures.add(cause, f"trajectory {traj.traj_id}: {failure}")
            return traj

        try:
            trajs = await gather_or_cancel(*(one(t) for t in group.trajectories))  # a failure stops the siblings
        except Exception as e:
            log.exception("group %s failed; its samples are dropped", group.group_id)
            self.counters["n_dropped"] += len(group.trajectories)
            self.items.pop(group.group_id, None)
            self.drop_turns(group)
            self._failed_groups_in_a_row += 1
            if self._failed_groups_in_a_row >= max(2, self.B // self.n) and self.fatal is None:
                # a batch's worth of groups failed and nothing else finished: the next ones would too
                self.fatal = generation_failure(self._failed_groups_in_a_row, e, self.cfg.rollout.workflow)
            await self.buffer.accept(group, [])
            return
        self._failed_groups_in_a_row = 0
        failed = [t for t in trajs if t.reward_failed]
        kept = trajs
        if failed and self.cfg.reward.on_failure == "drop":
            kept = [t for t in trajs if not t.reward_failed]
            self.counters["n_dropped"] += len(failed)
        if kept and self.cfg.rollout.filter_groups and len(kept) == len(trajs) and _all_equal(kept):
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
        self.items.pop(group.group_id, None)
        if self.fatal is None:  # with on_failure=drop nothing reaches a step: check here too, per B calls
            self.fatal = self.failure_error(self.step())
        accepted_total = await self.buffer.accept(group, kept)
        if kept and self.journal is not None:
            self.journal.write("accepted", {"step": self.step(), "accepted_total": accepted_total,
                                            "group_id": group.group_id, "traj_ids": [t.traj_id for t in kept]})

    def _resumable(self) -> bool:
        """Whether the workflow continues an episode from its trajectory and :class:`TurnPoint`."""
        return bool(getattr(self.workflow, "resumable", False))

    # -- generation ------------------------------------------------------------------
    async def run_workflow(self, traj: Trajectory) -> None:
        """Run (or, restored from a checkpoint, continue) the workflow of ``traj``.

        Its :class:`TurnPoint` goes once the workflow returned (:meth:`run_group` marks ``traj`` finished at once),
        not when it raised or was cancelled: its group then stops the siblings before it is dropped, and a
        checkpoint cut meanwhile keeps each of them whole, every token with its turn, so that a resume continues
        it (:meth:`drop_turns` forgets them with the group)."""
        point = self.turns.get(traj.traj_id)

        def generate(ctx: list[int], sampling: SamplingParams, into: Trajectory | None = None):
            return self._generate_turn(traj, into, ctx, sampling)

        if point is not None and self._resumable():
            await self.workflow.run(traj, generate, resume=point)
        else:
            await self.workflow.run(traj, generate)
        self.turns.pop(traj.traj_id, None)

    def drop_turns(self, group: Group) -> None:
        """Forget the turn points of ``group``'s trajectories (a failed group, dropped)."""
        for t in group.trajectories:
            self.turns.pop(t.traj_id, None)

    async def _generate_turn(self, traj: Trajectory, into: Trajectory | None, ctx: list[int],
                             sampling: SamplingParams) -> GenerateResult:
        """One policy turn of ``traj`` (or of ``into``, an agent's part), its :class:`TurnPoint` kept; the turn a
        checkpoint cut goes on from its tokens so far."""
        if into is not None and into is not traj:  # an agent's part: its episode never continues mid-way
            return await self.generation.generate(into, ctx, sampling)
        point = self.turns.get(traj.traj_id)
        carried = 0
        if point is not None and point.open:  # only a restored point is open when a turn begins
            carried = len(traj.response_ids) - point.start
        else:
            point = TurnPoint(turn=0 if point is None else point.turn + 1, start=len(traj.response_ids))
            self.turns[traj.traj_id] = point
        result = await self.generation.generate(traj, ctx, sampling, carried=carried)
        point.open = False
        return result

    def spawn(self, group: Group, item: Prompt) -> None:
        """Run ``group`` (of prompt ``item``) as a task of the loop."""
        task = asyncio.create_task(self.run_group(group, item))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def start_restored(self) -> None:
        """Start the groups a checkpoint kept running (:meth:`restore`)."""
        for group in self.restored:
            self.spawn(group, self.items[group.group_id])
        self.restored = []

    async def quiesce_for_stop(self) -> None:
        """Before a stop's checkpoint: hold new requests back, abort those in flight and wait for their partial
        tokens (within :data:`STOP_DRAIN_S` and the stop budget), so that nothing sampled is left out."""
        self.generation.close()
        if self.router.failure is not None:
            return
        try:
            await self.router.abort_all()
            await asyncio.wait_for(self.generation.drained(),
                                   stop_budget.bound(STOP_DRAIN_S))
        except Exception as e:  # the checkpoint is consistent without it: what did not come back is sampled again
            log.warning("the stop could not collect every request's partial tokens (%s: %s); those requests "
                        "continue from their last returned tokens on resume", type(e).__name__, e)

    # -- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Prompts taken but not admitted, and every running group whole (module doc); on the event loop. With
        ``logging.keep_running_groups=false`` only their prompts, and what that throws away (counted on resume)."""
        running = [g for g in sorted(self.buffer.running_groups.values(), key=lambda g: g.seq)
                   if g.group_id in self.items]  # a failed one is being dropped
        prompts = [p.to_dict() for p in self.regenerate]
        if not self.cfg.logging.keep_running_groups:
            trajs = [t for g in running for t in g.trajectories]
            return {"running_prompts": prompts + [self.items[g.group_id].to_dict() for g in running],
                    "running_groups": [], "thrown_away": {
                        "trajectories": len(trajs), "tokens": sum(r.n_policy_tokens for t in trajs for r in t.rows())}}
        groups = []
        for g in running:
            ids = {t.traj_id for t in g.trajectories}
            groups.append({"group_id": g.group_id, "start_version": g.start_version,
                           "prompt": self.items[g.group_id].to_dict(),
                           "trajectories": [t.to_dict() for t in g.trajectories],
                           "turns": {k: asdict(p) for k, p in self.turns.items() if k in ids}})
        return {"running_prompts": prompts, "running_groups": groups}

    def restore(self, state: dict[str, Any], id_prefix: str) -> None:
        """Admit the running groups of :meth:`state_dict` again (started by :meth:`start_restored`); those
        generated again get ids starting with ``id_prefix``. Call it after the counters are set. A checkpoint of
        an older megarl holds only prompts."""
        self.regenerate = [Prompt.from_dict(d) for d in state["running_prompts"]]
        thrown_away = state.get("thrown_away", {})  # logging.keep_running_groups=false
        self.counters["n_regenerated_after_resume"] += thrown_away.get("trajectories", 0)
        self.counters["n_tokens_regenerated_after_resume"] += thrown_away.get("tokens", 0)
        for d in state.get("running_groups", []):
            item = Prompt.from_dict(d["prompt"])
            turns = {k: TurnPoint(**p) for k, p in d["turns"].items()}
            if not self._resumable() and not any(t["finished"] for t in d["trajectories"]):
                self.regenerate.append(item)  # nothing to keep: the group starts again, as a new one
                self._count_regenerated([Trajectory.from_dict(t) for t in d["trajectories"]])
                continue
            group = Group(d["group_id"], int(d["start_version"]),
                          [self._restored_trajectory(Trajectory.from_dict(copy.deepcopy(t)), turns, item, id_prefix)
                           for t in d["trajectories"]])  # a copy: these go on growing, ``state`` stays as it was
            self.buffer.admit(group)
            self.items[group.group_id] = item
            self.restored.append(group)

    def _restored_trajectory(self, traj: Trajectory, turns: dict[str, TurnPoint], item: Prompt,
                             id_prefix: str) -> Trajectory:
        """``traj`` as it goes on after a resume: kept, continued at its turn, or started again (counted)."""
        point = turns.get(traj.traj_id)
        if traj.finished or (self._resumable() and (point is not None or not traj.response_ids)):
            self.counters["n_continued_after_resume"] += 1
            if point is not None and not traj.finished:
                self.turns[traj.traj_id] = point
            return traj
        self._count_regenerated([traj])  # an agent's episode may have begun outside the run even with no token
        return fresh_trajectory(f"{id_prefix}{traj.traj_id}", traj.group_id, item, self.strategy.exact)

    def _count_regenerated(self, trajs: list[Trajectory]) -> None:
        self.counters["n_regenerated_after_resume"] += len(trajs)
        self.counters["n_tokens_regenerated_after_resume"] += sum(r.n_policy_tokens for t in trajs for r in t.rows())

    async def cancel(self) -> None:
        """Cancel every group's task and wait for them (the loop's end)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _all_equal(trajs: list[Trajectory]) -> bool:
    rewards = [t.reward for t in trajs]
    return max(rewards) - min(rewards) <= 1e-9
