"""Replay buffer and staleness gate of the async loop (docs/design.md §4).

Counting is in trajectories. A group of n samples of one prompt is admitted
together and accepted together (its advantages need the whole group).

Gate: a group may start only if ``accepted + running + n <= (eta + v + 1) * B``
(v = published version, B = batch size), i.e. the per-request rule
``accepted + running < (eta + v + 1) * B`` applied to each of its samples.
``accepted`` leaves out the trajectories of skipped steps (non-finite loss or
gradient, :meth:`ReplayBuffer.release`): they left the buffer without an
optimizer step, so the version they were admitted against never came. Counted,
every skip would shrink the gate by B for good, and eta + 1 skips over a run
would close it.

How batches are formed (earliest deadline first, with a feasibility check).
A group admitted at version v_s must be trained at step v_s + eta at the
latest (its deadline): its first tokens keep their start version even when
interruption splices later ones. At step k the batch takes the ready groups
with the earliest deadlines, but only if every untrained group can still meet
its deadline afterwards: for each deadline d below v + eta (later deadlines
may still gain members from future admissions, which the gate bounds), the
untrained trajectories due by d that this batch leaves behind must fit into
steps k+1..d, i.e. ``U(d) - taken(<= d) <= (d - k) * B``. Otherwise the
trainer waits for a running group that is due. Taking younger groups first
whenever that is safe keeps the trainer from waiting on the long tail; the
check keeps every token within eta versions. With eta = 0 this is synchronous
RL.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

from megarl.types import Trajectory


@dataclass
class PublishedVersion:
    """The weight version the engines generate with (v of the gate); the controller advances it at each publish.

    Built before the controller, so that whatever reads it (the recovery context's live versions, the
    checkpoint) needs no reference to the controller.
    """

    value: int = 0


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
        self.released_total = 0  # of those, trajectories of skipped steps (no longer counted by the gate)
        self.running = 0  # trajectories admitted and not yet accepted or dropped
        self.running_groups: dict[str, Group] = {}
        self.ready: list[Group] = []
        self._seq = 0
        self._changed = asyncio.Condition()
        # ready and running_groups change on the event loop and are read from the trainer's thread
        # (live_trajectories): each change and each read holds this lock, so a read sees a group
        # either running or ready, never in between
        self._lock = threading.Lock()

    # -- gate --------------------------------------------------------------------
    def capacity(self, version: int) -> int:
        return (self.eta + version + 1) * self.B

    def can_admit(self, n: int, version: int) -> bool:
        return self.accepted_total - self.released_total + self.running + n <= self.capacity(version)

    async def wait_admissible(self, n: int, version: Callable[[], int], *, ready: Callable[[], bool] = lambda: True,
                              stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until a group of ``n`` may start at the published ``version()`` and ``ready()`` holds.

        Returns False instead once ``stop()`` holds. The callables are checked again at every change of
        the buffer and at every :meth:`notify` (call it when what they read changes).
        """
        async with self._changed:
            await self._changed.wait_for(lambda: stop() or (ready() and self.can_admit(n, version())))
            return not stop()

    def admit(self, group: Group) -> None:
        with self._lock:
            group.seq = self._seq
            self._seq += 1
            self.running += len(group.trajectories)
            self.running_groups[group.group_id] = group

    def release(self, n: int) -> None:
        """``n`` trajectories a skipped step took out without an optimizer step: the gate stops counting them."""
        with self._lock:
            self.released_total += n

    def gate_state(self, version: int) -> dict[str, int]:
        """The gate's numbers at published ``version`` (what a stalled loop reports)."""
        return {"accepted": self.accepted_total - self.released_total, "released": self.released_total,
                "running": self.running, "capacity": self.capacity(version), "ready": self.n_ready()}

    # -- completion --------------------------------------------------------------
    async def accept(self, group: Group, kept: list[Trajectory]) -> int:
        """A group finished: ``kept`` are its trajectories to train (failed ones may be dropped).

        Returns ``accepted_total`` right after this accept (what the accepted-ids journal records).
        """
        async with self._changed:
            with self._lock:
                self.running -= len(group.trajectories)
                self.running_groups.pop(group.group_id, None)
                self.accepted_total += len(kept)
                if kept:
                    group.trajectories = kept
                    self.ready.append(group)
            self._changed.notify_all()
            return self.accepted_total

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- batches -----------------------------------------------------------------
    def n_ready(self) -> int:
        return sum(len(g.trajectories) for g in self.ready)

    def _select(self, step: int, version: int) -> list[tuple[Group, int]] | None:
        """The batch for ``step`` as (group, rows taken), or None when the trainer must wait."""
        if self.n_ready() < self.B:
            return None
        ready = sorted(self.ready, key=lambda g: (g.start_version, g.seq))
        taken: list[tuple[Group, int]] = []
        n = 0
        for g in ready:
            if n == self.B:
                break
            k = min(len(g.trajectories), self.B - n)  # a group larger than what is left is split
            taken.append((g, k))
            n += k
        # feasibility: what is due by d and left behind must fit into the steps before d
        due: dict[int, int] = {}
        for g in list(self.ready) + list(self.running_groups.values()):
            d = g.start_version + self.eta
            due[d] = due.get(d, 0) + len(g.trajectories)
        taken_due: dict[int, int] = {}
        for g, k in taken:
            d = g.start_version + self.eta
            taken_due[d] = taken_due.get(d, 0) + k
        left = 0
        for d in sorted(due):
            if d >= version + self.eta:
                break
            left += due[d] - taken_due.get(d, 0)
            if left > (d - step) * self.B:
                return None
        return taken

    async def get_batch(self, step: int, version: int | None = None) -> list[Trajectory]:
        """B accepted trajectories for optimizer step ``step`` (``version``: the published version)."""
        version = step if version is None else version
        async with self._changed:
            await self._changed.wait_for(lambda: self._select(step, version) is not None)
            batch: list[Trajectory] = []
            with self._lock:
                for g, k in self._select(step, version):
                    batch += g.trajectories[:k]
                    g.trajectories = g.trajectories[k:]
                    if not g.trajectories:
                        self.ready.remove(g)
            return batch

    # -- views for recovery --------------------------------------------------------
    def live_trajectories(self) -> list[Trajectory]:
        """Ready and running trajectories (every training row of an episode), as one consistent view (safe
        from the trainer's thread)."""
        with self._lock:
            out = [r for g in self.ready for t in g.trajectories for r in t.rows()]
            out += [r for g in self.running_groups.values() for t in g.trajectories for r in t.rows()]
        return out

    def live_versions(self, published: int) -> set[int]:
        """Versions a live token still references, and ``published`` (the engines' next tokens will)."""
        versions = {published}
        for t in self.live_trajectories():
            versions |= t.policy_versions()
        return versions

    def state_dict(self) -> dict:
        """Accepted-but-untrained groups (trajectories as plain data) and the gate's counters.

        Running groups are not part of it: nothing of them was accepted; the
        controller keeps them and admits them again on resume (``running`` restarts
        at 0; megarl/loop/running_groups.py).
        """
        return {"accepted_total": self.accepted_total, "released_total": self.released_total, "seq": self._seq,
                "ready": [{"group_id": g.group_id, "start_version": g.start_version, "seq": g.seq,
                           "trajectories": [t.to_dict() for t in g.trajectories]} for g in self.ready]}

    def load_state_dict(self, state: dict) -> None:
        ready = [Group(d["group_id"], d["start_version"], [Trajectory.from_dict(t) for t in d["trajectories"]],
                       d["seq"]) for d in state["ready"]]
        with self._lock:
            self.accepted_total = state["accepted_total"]
            self.released_total = state.get("released_total", 0)  # absent from checkpoints of older runs
            self._seq = state["seq"]
            self.ready = ready
            self.running = 0
            self.running_groups = {}
