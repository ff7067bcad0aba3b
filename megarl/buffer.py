"""Replay buffer and staleness gate of the async loop (DESIGN §4).

Counting is in trajectories. A group of n samples of one prompt is admitted
together and accepted together (its advantages need the whole group).

Gate: a group may start only if ``accepted + running + n <= (eta + v + 1) * B``
(v = published version, B = batch size), i.e. the per-request rule
``accepted + running < (eta + v + 1) * B`` applied to each of its samples.

Why batches are formed oldest-start-version first: a group admitted at
version v_s has an admission index below (eta + v_s + 1) * B, so at most B
admitted-but-untrained trajectories have a deadline v_s + eta <= k at train
step k. Taking the B accepted trajectories with the smallest start version, and
waiting for any still-running group whose deadline is this step, therefore
trains every token at most eta versions after it was sampled — also for
sequences spliced across versions by interruption, whose first tokens keep
their start version. With eta = 0 this is synchronous RL.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from megarl.types import Trajectory


@dataclass
class Group:
    """The n samples of one prompt, admitted at ``start_version``."""

    group_id: str
    start_version: int
    trajectories: list[Trajectory] = field(default_factory=list)
    #: admission order, breaks ties between groups of the same start version
    seq: int = 0


class ReplayBuffer:
    """Accepted groups waiting to be trained, plus the gate's counters."""

    def __init__(self, batch_size: int, eta: int) -> None:
        self.B = batch_size
        self.eta = eta
        self.accepted_total = 0  # trajectories accepted since the start (trained or not)
        self.running = 0  # trajectories admitted and not yet accepted or dropped
        self.running_groups: dict[str, Group] = {}
        self.ready: list[Group] = []
        self._seq = 0
        self._changed = asyncio.Condition()

    # -- gate --------------------------------------------------------------------
    def capacity(self, version: int) -> int:
        return (self.eta + version + 1) * self.B

    def can_admit(self, n: int, version: int) -> bool:
        return self.accepted_total + self.running + n <= self.capacity(version)

    def admit(self, group: Group) -> None:
        group.seq = self._seq
        self._seq += 1
        self.running += len(group.trajectories)
        self.running_groups[group.group_id] = group

    # -- completion --------------------------------------------------------------
    async def accept(self, group: Group, kept: list[Trajectory]) -> None:
        """A group finished: ``kept`` are its trajectories to train (failed ones may be dropped)."""
        async with self._changed:
            self.running -= len(group.trajectories)
            self.running_groups.pop(group.group_id, None)
            self.accepted_total += len(kept)
            if kept:
                group.trajectories = kept
                self.ready.append(group)
            self._changed.notify_all()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- batches -----------------------------------------------------------------
    def n_ready(self) -> int:
        return sum(len(g.trajectories) for g in self.ready)

    def _batch_possible(self, step: int) -> bool:
        if self.n_ready() < self.B:
            return False
        # a running group that must be trained at this step holds the batch back
        return not any(g.start_version + self.eta <= step for g in self.running_groups.values())

    async def get_batch(self, step: int) -> list[Trajectory]:
        """The B accepted trajectories with the oldest start version (whole groups)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._batch_possible(step))
            self.ready.sort(key=lambda g: (g.start_version, g.seq))
            batch: list[Trajectory] = []
            while self.ready and len(batch) + len(self.ready[0].trajectories) <= self.B:
                batch += self.ready.pop(0).trajectories
            if len(batch) < self.B and self.ready:
                # a group larger than what is left (a batch size that is no multiple of n): split it
                g = self.ready[0]
                take = self.B - len(batch)
                batch += g.trajectories[:take]
                g.trajectories = g.trajectories[take:]
            return batch

    # -- views for recovery --------------------------------------------------------
    def live_trajectories(self) -> list[Trajectory]:
        # list() copies in one step under the GIL: safe to call from the trainer's worker thread
        out = [t for g in list(self.ready) for t in list(g.trajectories)]
        out += [t for g in list(self.running_groups.values()) for t in list(g.trajectories)]
        return out

    def state_dict(self) -> dict:
        return {"accepted_total": self.accepted_total, "seq": self._seq,
                "ready": [{"group_id": g.group_id, "start_version": g.start_version, "seq": g.seq,
                           "trajectories": [t.to_dict() for t in g.trajectories]} for g in self.ready]}

    def load_state_dict(self, state: dict) -> None:
        self.accepted_total = state["accepted_total"]
        self._seq = state["seq"]
        self.ready = [Group(d["group_id"], d["start_version"],
                            [Trajectory.from_dict(t) for t in d["trajectories"]], d["seq"])
                      for d in state["ready"]]
