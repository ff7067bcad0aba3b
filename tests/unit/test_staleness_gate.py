"""The async loop's staleness bound under random generation lengths and timings.

The controller, replay buffer and recovery hooks are the real ones. The engine
and the trainer are replaced by timing simulators (``SimulatedEngineForGateTests``,
``StepCounterTrainerForGateTests``) because this property is about scheduling:
hypothesis draws thousands of interleavings, far more than real engines allow.
The real engine and trainer run the same loop in tests/e2e.
"""
import asyncio
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.builder import load_run_config
from megarl.loop.buffer import PublishedVersion, ReplayBuffer
from megarl.loop.controller import Controller
from megarl.types import GenerateResult
from recovery.base import RecoveryContext
from recovery.behav import Behav


class SimulatedEngineForGateTests:
    """Emits tokens one at a time with random delays; abort ends every request with its partial output.

    A router of one engine that never fails (megarl.rollout.base.RouterProtocol)."""

    def __init__(self, rng: random.Random, max_len: int):
        self.rng = rng
        self.max_len = max_len
        self.version = 0
        self.abort_event = asyncio.Event()
        self.failure = None

    async def wait_available(self):
        """Its one engine is never lost."""

    def stats(self):
        return {}

    async def generate(self, req):
        n_target = min(req.sampling.max_new_tokens, 1 + int(self.rng.expovariate(1 / 4)))
        out, vers = [], []
        while len(out) < n_target:
            try:
                await asyncio.wait_for(self.abort_event.wait(), timeout=self.rng.random() * 2e-3)
                return GenerateResult(req.request_id, out, [-1.0] * len(out), vers, "abort")
            except asyncio.TimeoutError:
                pass
            out.append(4)
            vers.append(self.version)
        return GenerateResult(req.request_id, out, [-1.0] * len(out), vers,
                              "stop" if n_target < req.sampling.max_new_tokens else "length")

    async def abort_all(self):
        self.abort_event.set()
        await asyncio.sleep(0)
        self.abort_event = asyncio.Event()


class StepCounterTrainerForGateTests:
    """Counts optimizer steps and records what each step trained on.

    ``skip``: indices of train_step calls that behave like a step with a
    non-finite loss (no optimizer step: the version stays, ``skipped`` is 1).
    """

    def __init__(self, rng, skip=()):
        self.version = 0
        self.rng = rng
        self.trained = []
        self.row_versions = {}  # trajectory id -> the versions of its policy tokens, as trained
        self.skip = set(skip)
        self.n_calls = 0
        self.last_skip_reason = None

    def train_step(self, batch, loss_fn):
        import time

        time.sleep(self.rng.random() * 3e-3)
        mask = batch.loss_mask > 0
        self.trained.append((batch.version, batch.versions[mask].tolist(), list(batch.traj_ids)))
        self.row_versions.update({tid: batch.versions[i][mask[i]].tolist() for i, tid in enumerate(batch.traj_ids)})
        skipped = self.n_calls in self.skip
        self.n_calls += 1
        if skipped:
            self.last_skip_reason = "non-finite loss"
            return {"loss": float("nan"), "skipped": 1.0}
        self.version += 1
        return {"loss": 0.0, "skipped": 0.0}


class SingleTurn:
    async def run(self, traj, generate):
        from megarl.types import SamplingParams

        await generate(traj.prompt_ids, SamplingParams(max_new_tokens=12))
        return traj

    def stats(self):
        return {}


class Rewards:
    async def score(self, traj):
        await asyncio.sleep(0)
        return SimpleNamespace(reward=float(len(traj.response_ids)), failed=False, reason=None)


class SimulatedPublisher:
    """Publishing to the simulated engine: its tokens carry the new version."""

    def __init__(self, engine):
        self.engine = engine

    async def prepare(self, version):
        pass

    async def apply(self, version):
        self.engine.version = version


def zero_advantages(trajs):
    for t in trajs:
        t.advantage = 0.0


def run_loop(eta: int, B: int, n: int, steps: int, seed: int, interruptible: bool = True, skip=(),
             overrides=(), rewards=None, checkpointer=None, timeout_s: float = 60.0):
    """The loop for ``steps`` steps; ``timeout_s`` bounds the wall time (a hang fails as TimeoutError)."""
    rng = random.Random(seed)
    cfg = load_run_config(None, [f"rollout.eta={eta}", f"trainer.batch_size={B}", f"rollout.group_size={n}",
                                 f"rollout.interruptible={str(interruptible).lower()}", *overrides])
    engine = SimulatedEngineForGateTests(rng, 12)
    trainer = StepCounterTrainerForGateTests(rng, skip)
    prompts = iter(lambda: SimpleNamespace(prompt_id="p", prompt_ids=[1, 5, 2], answer=None, row={}), None)

    publisher = SimulatedPublisher(engine)

    records = []
    c = Controller(cfg, trainer=trainer, router=engine, buffer=ReplayBuffer(B, eta), published=PublishedVersion(),
                   rewards=rewards or Rewards(), dataset=prompts, workflow=SingleTurn(),
                   strategy=Behav(None, RecoveryContext(trainer=trainer)),
                   publisher=publisher, loss_fn_factory=lambda b, a: None, advantages=zero_advantages,
                   on_step=records.append, checkpointer=checkpointer)
    asyncio.run(asyncio.wait_for(c.train(steps), timeout_s))
    trainer.held = c.generation.held
    return trainer, records


@settings(deadline=None, max_examples=60)
@given(eta=st.integers(0, 3), groups_per_batch=st.integers(1, 3), n=st.integers(1, 4),
       seed=st.integers(0, 10_000), interruptible=st.booleans())
def test_staleness_bound_never_violated(eta, groups_per_batch, n, seed, interruptible):
    trainer, records = run_loop(eta, groups_per_batch * n, n, steps=6, seed=seed, interruptible=interruptible)
    assert len(trainer.trained) == 6
    seen = set()
    for version, token_versions, ids in trainer.trained:
        assert token_versions, "every batch trains some policy tokens"
        assert max(version - v for v in token_versions) <= eta
        assert min(version - v for v in token_versions) >= 0
        assert not (seen & set(ids)), "a trajectory was trained twice"
        seen |= set(ids)
        if eta == 0:
            assert set(token_versions) == {version}
    assert all(r["staleness_max"] <= eta for r in records)


@settings(deadline=None, max_examples=60)
@given(eta=st.integers(1, 5), groups_per_batch=st.integers(1, 3), n=st.integers(1, 4), splice_at=st.integers(1, 6),
       seed=st.integers(0, 10_000), interruptible=st.booleans())
def test_splice_holds_splice_every_held_trajectory_and_never_stall_the_loop(eta, groups_per_batch, n, splice_at,
                                                                            seed, interruptible):
    # rollout.splice_at_tokens: a held turn waits for the next publish; the loop must still finish every step
    # (a hang fails as TimeoutError) within the staleness bound, and a held trajectory is spliced exactly at
    # the hold: its first splice_at tokens of one version, every later token of a later one
    trainer, records = run_loop(eta, groups_per_batch * n, n, steps=6, seed=seed, interruptible=interruptible,
                                overrides=[f"rollout.splice_at_tokens={splice_at}"], timeout_s=20.0)
    assert len(trainer.trained) == 6
    assert all(r["staleness_max"] <= eta for r in records)
    assert sum(r["n_splice_holds"] for r in records) <= len(trainer.held)  # holds after the last step: unlogged
    for tid in trainer.held & set(trainer.row_versions):
        versions = trainer.row_versions[tid]
        assert len(set(versions[:splice_at])) == 1 and min(versions[splice_at:]) > versions[0], (tid, versions)


def test_splice_holds_happen_by_construction():
    # the same seed without holds splices less; with holds every other group's trajectories that run past
    # 2 tokens before a publish are held and spliced
    _, plain = run_loop(eta=2, B=8, n=4, steps=8, seed=5, interruptible=False)
    trainer, held = run_loop(eta=2, B=8, n=4, steps=8, seed=5, interruptible=False,
                             overrides=["rollout.splice_at_tokens=2"])
    assert sum(r["n_spliced"] for r in plain) == 0
    assert 0 < sum(r["n_splice_holds"] for r in held) <= len(trainer.held)
    assert sum(r["n_spliced"] for r in held) >= len(trainer.held & set(trainer.row_versions)) > 0


def test_async_run_interrupts_and_splices():
    trainer, records = run_loop(eta=2, B=8, n=4, steps=8, seed=3)
    assert sum(r["n_interrupted"] for r in records) > 0
    assert sum(r["n_spliced"] for r in records) > 0
    assert max(r["staleness_max"] for r in records) <= 2


def test_versions_and_eta_count_optimizer_steps_with_publish_every_2():
    # versions are optimizer-step counts: with publish_every = 2 the engines generate with 0, 2, 4, ...;
    # eta bounds the lag (trainer version - v_t) in optimizer steps, so all of 0..eta occur, never more
    # (the EWMA's default window, recovery/ewma.py, relies on this)
    for seed in (1, 2):
        trainer, _ = run_loop(eta=2, B=4, n=2, steps=10, seed=seed,
                              overrides=["trainer.publish_every=2"])
        versions = {v for _, tv, _ in trainer.trained for v in tv}
        lags = {version - v for version, tv, _ in trainer.trained for v in tv}
        assert versions <= {0, 2, 4, 6, 8} and len(versions) >= 3
        assert lags == {0, 1, 2}


# -- skipped steps, publish_every and the watchdog ----------------------------------------------------
def check_trained(trainer, eta, steps):
    """Every step (skipped ones too) trained B fresh trajectories, each token at most eta versions old."""
    assert len(trainer.trained) == steps
    seen = set()
    for version, token_versions, ids in trainer.trained:
        assert token_versions and 0 <= min(version - v for v in token_versions)
        assert max(version - v for v in token_versions) <= eta, (version, sorted(set(token_versions)))
        assert not (seen & set(ids)), "a trajectory was trained twice"
        seen |= set(ids)


def test_skipped_step_does_not_close_the_gate_synchronous():
    # eta=0, B=4: step 0 trains (v1, capacity 8), step 1 is skipped. Its 4 trajectories left without
    # an optimizer step, so they must stop counting against the gate, or capacity 8 stays full forever.
    trainer, records = run_loop(eta=0, B=4, n=2, steps=4, seed=1, skip={1})
    check_trained(trainer, 0, 4)
    assert [r["skipped"] for r in records] == [0.0, 1.0, 0.0, 0.0]
    assert trainer.version == 3 and [r["version"] for r in records] == [1, 1, 2, 3]


def test_skips_spread_over_the_run_do_not_exhaust_the_gate():
    # eta=1: three skips, never two in a row, more than eta + 1 = 2 over the run
    trainer, records = run_loop(eta=1, B=4, n=2, steps=9, seed=2, skip={1, 4, 7})
    check_trained(trainer, 1, 9)
    assert trainer.version == 6 and max(r["consecutive_skips"] for r in records) == 1


def test_max_consecutive_skips_fires_beyond_eta_plus_one():
    # eta=1 lets 2 batches out before the first publish; the third consecutive skip must still be counted
    from megarl.errors import TrainingError

    with pytest.raises(TrainingError, match=r"3 consecutive steps skipped .*trainer.max_consecutive_skips=3"):
        run_loop(eta=1, B=4, n=2, steps=10, seed=3, skip=range(10),
                 overrides=["trainer.max_consecutive_skips=3"])


class CountingCheckpointer:
    def __init__(self):
        self.saved = []
        self.last_step = None

    async def save(self, controller, background=False):
        self.saved.append((controller.step, controller.buffer.state_dict()))
        self.last_step = controller.step

    async def wait(self):
        return None


def test_stall_watchdog_checkpoints_and_names_the_gate():
    # publish_every=2 > eta+1=1 (validate refuses it; the Controller alone does not): step 0 trains,
    # version 1 is never published, so capacity stays (0+0+1)*4 = 4 and the 4 accepted fill it for good
    from megarl.errors import TrainingError

    ck = CountingCheckpointer()
    with pytest.raises(TrainingError) as e:
        run_loop(eta=0, B=4, n=4, steps=3, seed=4, checkpointer=ck,
                 overrides=["trainer.publish_every=2", "trainer.stall_timeout_s=1"])
    msg = str(e.value)
    for part in ("no batch for step 1", "1.0 s", "accepted 4", "running 0", "capacity 4", "version 0",
                 "trainer version 1", "ready 0", "trainer.stall_timeout_s"):
        assert part in msg, (part, msg)
    assert [s for s, _ in ck.saved] == [1], "a checkpoint of the stalled step"
    assert ck.saved[0][1]["accepted_total"] == 4


@settings(deadline=None, max_examples=40)
@given(eta=st.integers(0, 3), data=st.data(), groups_per_batch=st.integers(1, 3), n=st.integers(1, 4),
       seed=st.integers(0, 10_000), interruptible=st.booleans())
def test_staleness_bound_with_skips_and_publish_every(eta, data, groups_per_batch, n, seed, interruptible):
    steps = 7
    publish_every = data.draw(st.integers(1, eta + 1), label="publish_every")
    skip = data.draw(st.sets(st.integers(0, steps - 1)), label="skip")
    trainer, records = run_loop(eta, groups_per_batch * n, n, steps=steps, seed=seed, interruptible=interruptible,
                                skip=skip, timeout_s=60,
                                overrides=[f"trainer.publish_every={publish_every}", "trainer.max_consecutive_skips=0"])
    check_trained(trainer, eta, steps)
    assert trainer.version == steps - len(skip)
    assert [bool(r["skipped"]) for r in records] == [i in skip for i in range(steps)]
    assert all(r["staleness_max"] <= eta for r in records)
