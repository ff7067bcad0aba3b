"""Batch selection of the replay buffer: earliest deadline first, never at the cost of a later deadline."""
from megarl.loop.buffer import Group, ReplayBuffer
from megarl.types import Trajectory


def group(gid: str, start_version: int, n: int = 1) -> Group:
    return Group(gid, start_version, [Trajectory(f"{gid}-{j}", gid, [1, 2]) for j in range(n)])


def buffer_with(ready, running, B=2, eta=3):
    buf = ReplayBuffer(batch_size=B, eta=eta)
    for g in ready + running:
        buf.admit(g)
    for g in ready:
        buf.running_groups.pop(g.group_id)
        buf.ready.append(g)
    return buf


def test_younger_group_waits_when_older_ones_would_miss_their_deadline():
    # eta=3, B=2, step 2: g0, g2, g5 (start v0, due at step 3) still run; g7 (v0) and g8 (v1) are ready.
    # Taking g7+g8 would leave three trajectories due at step 3 for one batch of 2: wait instead.
    ready = [group("g7", 0), group("g8", 1)]
    running = [group("g0", 0), group("g2", 0), group("g5", 0)]
    assert buffer_with(ready, running)._select(step=2, version=2) is None


def test_younger_group_taken_when_older_ones_still_fit():
    # with only g0 and g2 running, steps 3 can still take both: g7+g8 now is safe
    ready = [group("g7", 0), group("g8", 1)]
    running = [group("g0", 0), group("g2", 0)]
    taken = buffer_with(ready, running)._select(step=2, version=2)
    assert [(g.group_id, k) for g, k in taken] == [("g7", 1), ("g8", 1)]


def test_due_group_running_holds_the_batch():
    # g0 is due at this very step (start v0 + eta 3 = 3) and still runs: nothing else may go first
    ready = [group("g9", 2), group("g10", 2)]
    assert buffer_with(ready, [group("g0", 0)])._select(step=3, version=3) is None


def test_earliest_deadline_first_and_group_split():
    ready = [group("young", 2, n=2), group("old", 1, n=1)]
    taken = buffer_with(ready, [], B=2, eta=1)._select(step=2, version=2)
    assert [(g.group_id, k) for g, k in taken] == [("old", 1), ("young", 1)]


def test_not_enough_ready():
    assert buffer_with([group("a", 0)], [], B=2)._select(step=0, version=0) is None


class _HookedGroups(dict):
    """running_groups that runs ``hook`` once, when a reader asks for its values (after ``ready`` was read)."""

    hook = None

    def values(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().values()


def test_live_trajectories_sees_a_group_accepted_while_it_reads():
    # The trainer's thread reads the live trajectories while the event loop accepts a group. The hook
    # stops the reader between reading `ready` and reading `running_groups` and lets the accept run
    # there: a consistent view holds the group exactly once (before or after its move), never zero times.
    import asyncio
    import threading

    buf = ReplayBuffer(batch_size=2, eta=1)
    buf.running_groups = _HookedGroups()
    g = group("g0", 0, n=2)
    buf.admit(g)
    between, accepted = threading.Event(), threading.Event()

    def hook():
        between.set()
        accepted.wait(timeout=2.0)  # the accept may run here, unless the buffer makes it wait for this read

    buf.running_groups.hook = hook
    seen: list = []
    reader = threading.Thread(target=lambda: seen.append(buf.live_trajectories()))
    reader.start()
    assert between.wait(timeout=10), "live_trajectories never read running_groups"
    asyncio.run(buf.accept(g, list(g.trajectories)))
    accepted.set()
    reader.join(timeout=10)
    assert [t.traj_id for t in seen[0]] == ["g0-0", "g0-1"]
    assert buf.ready == [g] and not buf.running_groups


def test_wait_admissible():
    import asyncio

    async def scenario():
        buf = ReplayBuffer(batch_size=2, eta=0)
        buf.admit(group("g0", 0, n=2))  # capacity (0 + 0 + 1) * 2 = 2 is full
        stop = False
        waiter = asyncio.ensure_future(buf.wait_admissible(2, lambda: 0, stop=lambda: stop))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await buf.accept(buf.running_groups["g0"], [])  # dropped: leaves the gate's count
        assert await asyncio.wait_for(waiter, 5) is True
        buf.admit(group("g1", 0, n=2))
        waiter = asyncio.ensure_future(buf.wait_admissible(2, lambda: 0, stop=lambda: stop))
        await asyncio.sleep(0.01)
        stop = True
        await buf.notify()
        assert await asyncio.wait_for(waiter, 5) is False

    asyncio.run(scenario())
