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

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.config import load_config
from megarl.controller import Controller
from megarl.types import AnchorResult, GenerateResult
from recovery.behav import Behav
from recovery.base import RecoveryContext


class SimulatedEngineForGateTests:
    """Emits tokens one at a time with random delays; abort ends every request with its partial output."""

    def __init__(self, rng: random.Random, max_len: int):
        self.rng = rng
        self.max_len = max_len
        self.version = 0
        self.abort_event = asyncio.Event()

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
    """Counts optimizer steps and records what each step trained on."""

    def __init__(self, rng):
        self.version = 0
        self.rng = rng
        self.trained = []

    def train_step(self, batch, loss_fn):
        import time

        time.sleep(self.rng.random() * 3e-3)
        mask = batch.loss_mask > 0
        self.trained.append((batch.version, batch.versions[mask].tolist(), list(batch.traj_ids)))
        self.version += 1
        return {"loss": 0.0}


class SingleTurn:
    async def run(self, traj, generate):
        from megarl.types import SamplingParams

        await generate(traj.prompt_ids, SamplingParams(max_new_tokens=12))
        return traj


class Rewards:
    async def score(self, traj):
        await asyncio.sleep(0)
        return SimpleNamespace(reward=float(len(traj.response_ids)), failed=False, reason=None)


def run_loop(eta: int, B: int, n: int, steps: int, seed: int, interruptible: bool = True, publish_every: int = 1):
    rng = random.Random(seed)
    cfg = load_config(None, [f"rollout.eta={eta}", f"trainer.batch_size={B}", f"rollout.group_size={n}",
                             f"rollout.interruptible={str(interruptible).lower()}",
                             f"trainer.publish_every={publish_every}"])
    engine = SimulatedEngineForGateTests(rng, 12)
    trainer = StepCounterTrainerForGateTests(rng)
    prompts = iter(lambda: SimpleNamespace(prompt_id="p", prompt_ids=[1, 5, 2], answer=None, row={}), None)

    class Publisher:
        async def prepare(self, version):
            pass

        async def apply(self, version):
            engine.version = version

    publisher = Publisher()

    def advantages(trajs):
        for t in trajs:
            t.advantage = 0.0

    records = []
    c = Controller(cfg, trainer=trainer, router=engine, rewards=Rewards(), dataset=prompts,
                   workflow=SingleTurn(), strategy=Behav(None, RecoveryContext(trainer=trainer)),
                   publisher=publisher, loss_fn_factory=lambda b, a: None, advantages=advantages,
                   on_step=records.append)
    asyncio.run(c.train(steps))
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
        trainer, _ = run_loop(eta=2, B=4, n=2, steps=10, seed=seed, publish_every=2)
        versions = {v for _, tv, _ in trainer.trained for v in tv}
        lags = {version - v for version, tv, _ in trainer.trained for v in tv}
        assert versions <= {0, 2, 4, 6, 8} and len(versions) >= 3
        assert lags == {0, 1, 2}
