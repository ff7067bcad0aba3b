"""Running groups across a checkpoint: what a stop keeps of the groups still generating, and how a resume goes on.

A checkpoint keeps every running group whole (:meth:`RunningGroups._running_state`):

* trajectories whose workflow returned, with everything the buffer keeps for accepted ones (scored, or still
  waiting for their score);
* partial ones with their tokens so far, per-token versions, ``logp_behav``, any recovered ``logp_old`` and
  their routes, and where their workflow stands (:class:`TurnPoint`: the policy turn in progress, the response
  tokens before it, and whether its generation had returned).

The cut is the event loop's, so no token is both kept and generated again: a request in flight has given the
trajectory only the chunks that came back before it (an interruption's), and what the engine sampled since is
not kept, and is sampled again on resume. A stop first aborts every request and waits for its partial tokens
(:meth:`RunningGroups._quiesce_for_stop`), so that its checkpoint leaves out nothing that was sampled. A
trajectory keeps its turn until its workflow returned, also while a failed group stops its siblings before it
is dropped: a cut then keeps each of them with its turn, never tokens without one (which could not continue).

On resume (:meth:`RunningGroups._restore_running`) each group is admitted again with its start version (its
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

:class:`RunningGroups` is a part of :class:`megarl.loop.controller.Controller` kept in a file of its own; it reads
the controller's ``buffer``, ``workflow``, ``generation``, ``router``, ``strategy``, ``counters``, ``cfg``,
``id_prefix``, ``_items``, ``_regenerate``, ``_turns``, ``_restored``, ``_tasks`` and ``_run_group``.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import asdict
from typing import Any

from megarl.data import Prompt
from megarl.loop.buffer import Group
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
    """The controller's running groups in a checkpoint and on resume (module doc)."""

    def _resumable(self) -> bool:
        """Whether the workflow continues an episode from its trajectory and :class:`TurnPoint`."""
        return bool(getattr(self.workflow, "resumable", False))

    # -- generation ------------------------------------------------------------------
    async def _run_workflow(self, traj: Trajectory) -> None:
        """Run (or, restored from a checkpoint, continue) the workflow of ``traj``.

        Its :class:`TurnPoint` goes once the workflow returned (the controller marks ``traj`` finished at once),
        not when it raised or was cancelled: its group then stops the siblings before it is dropped, and a
        checkpoint cut meanwhile keeps each of them whole, every token with its turn, so that a resume continues
        it (:meth:`_drop_turns` forgets them with the group)."""
        point = self._turns.get(traj.traj_id)

        def generate(ctx: list[int], sampling: SamplingParams, into: Trajectory | None = None):
            return self._generate_turn(traj, into, ctx, sampling)

        if point is not None and self._resumable():
            await self.workflow.run(traj, generate, resume=point)
        else:
            await self.workflow.run(traj, generate)
        self._turns.pop(traj.traj_id, None)

    def _drop_turns(self, group: Group) -> None:
        """Forget the turn points of ``group``'s trajectories (a failed group, dropped)."""
        for t in group.trajectories:
            self._turns.pop(t.traj_id, None)

    async def _generate_turn(self, traj: Trajectory, into: Trajectory | None, ctx: list[int],
                             sampling: SamplingParams) -> GenerateResult:
        """One policy turn of ``traj`` (or of ``into``, an agent's part), its :class:`TurnPoint` kept; the turn a
        checkpoint cut goes on from its tokens so far."""
        if into is not None and into is not traj:  # an agent's part: its episode never continues mid-way
            return await self.generation.generate(into, ctx, sampling)
        point = self._turns.get(traj.traj_id)
        carried = 0
        if point is not None and point.open:  # only a restored point is open when a turn begins
            carried = len(traj.response_ids) - point.start
        else:
            point = TurnPoint(turn=0 if point is None else point.turn + 1, start=len(traj.response_ids))
            self._turns[traj.traj_id] = point
        result = await self.generation.generate(traj, ctx, sampling, carried=carried)
        point.open = False
        return result

    def _spawn(self, group: Group, item: Prompt) -> None:
        """Run ``group`` (of prompt ``item``) as a task of the loop."""
        task = asyncio.create_task(self._run_group(group, item))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_restored(self) -> None:
        """Start the groups a checkpoint kept running (:meth:`_restore_running`)."""
        for group in self._restored:
            self._spawn(group, self._items[group.group_id])
        self._restored = []

    async def _quiesce_for_stop(self) -> None:
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
    def _running_state(self) -> dict[str, Any]:
        """Prompts taken but not admitted, and every running group whole (module doc); on the event loop. With
        ``logging.keep_running_groups=false`` only their prompts, and what that throws away (counted on resume)."""
        running = [g for g in sorted(self.buffer.running_groups.values(), key=lambda g: g.seq)
                   if g.group_id in self._items]  # a failed one is being dropped
        prompts = [p.to_dict() for p in self._regenerate]
        if not self.cfg.logging.keep_running_groups:
            trajs = [t for g in running for t in g.trajectories]
            return {"running_prompts": prompts + [self._items[g.group_id].to_dict() for g in running],
                    "running_groups": [], "thrown_away": {
                        "trajectories": len(trajs), "tokens": sum(r.n_policy_tokens for t in trajs for r in t.rows())}}
        groups = []
        for g in running:
            ids = {t.traj_id for t in g.trajectories}
            groups.append({"group_id": g.group_id, "start_version": g.start_version,
                           "prompt": self._items[g.group_id].to_dict(),
                           "trajectories": [t.to_dict() for t in g.trajectories],
                           "turns": {k: asdict(p) for k, p in self._turns.items() if k in ids}})
        return {"running_prompts": prompts, "running_groups": groups}

    def _restore_running(self, state: dict[str, Any]) -> None:
        """Admit the running groups of :meth:`_running_state` again (started by :meth:`_start_restored`); call
        it after ``id_prefix`` and the counters are set. A checkpoint of an older megarl holds only prompts."""
        self._regenerate = [Prompt.from_dict(d) for d in state["running_prompts"]]
        thrown_away = state.get("thrown_away", {})  # logging.keep_running_groups=false
        self.counters["n_regenerated_after_resume"] += thrown_away.get("trajectories", 0)
        self.counters["n_tokens_regenerated_after_resume"] += thrown_away.get("tokens", 0)
        for d in state.get("running_groups", []):
            item = Prompt.from_dict(d["prompt"])
            turns = {k: TurnPoint(**p) for k, p in d["turns"].items()}
            if not self._resumable() and not any(t["finished"] for t in d["trajectories"]):
                self._regenerate.append(item)  # nothing to keep: the group starts again, as a new one
                self._count_regenerated([Trajectory.from_dict(t) for t in d["trajectories"]])
                continue
            group = Group(d["group_id"], int(d["start_version"]),
                          [self._restored_trajectory(Trajectory.from_dict(copy.deepcopy(t)), turns, item)
                           for t in d["trajectories"]])  # a copy: these go on growing, ``state`` stays as it was
            self.buffer.admit(group)
            self._items[group.group_id] = item
            self._restored.append(group)

    def _restored_trajectory(self, traj: Trajectory, turns: dict[str, TurnPoint], item: Prompt) -> Trajectory:
        """``traj`` as it goes on after a resume: kept, continued at its turn, or started again (counted)."""
        point = turns.get(traj.traj_id)
        if traj.finished or (self._resumable() and (point is not None or not traj.response_ids)):
            self.counters["n_continued_after_resume"] += 1
            if point is not None and not traj.finished:
                self._turns[traj.traj_id] = point
            return traj
        self._count_regenerated([traj])  # an agent's episode may have begun outside the run even with no token
        return fresh_trajectory(f"{self.id_prefix}{traj.traj_id}", traj.group_id, item, self.strategy.exact)

    def _count_regenerated(self, trajs: list[Trajectory]) -> None:
        self.counters["n_regenerated_after_resume"] += len(trajs)
        self.counters["n_tokens_regenerated_after_resume"] += sum(r.n_policy_tokens for t in trajs for r in t.rows())
