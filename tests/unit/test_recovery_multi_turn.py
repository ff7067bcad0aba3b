"""Exact strategies inside the loop with the multi-turn workflow, under interruptions.

The Controller, ReplayBuffer, MultiTurnWorkflow with DigitCountEnv, the HF
rollout engine (in this process), the disk publisher, the strategies and
recovery.verifier.VerifyingStrategy (anchor vs the true ``logp_old``: a forward of
each token's own version) are the real ones. The trainer is HFScorerForTests
(tests/unit/recovery_scorer.py), whose ``fake_step`` stands in for the
optimizer step, and rewards come from a small in-process stand-in, so the test
stays a unit test. Every publish aborts what the engine is generating, so
trajectories are caught mid-turn and between turns (waiting for the tool or
for their next turn), the case a multi-turn trajectory adds.
"""
import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, run_tokenizer
from recovery_scorer import HFScorerForTests, tiny_checkpoint

from megarl.types import NO_VERSION

STEPS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


class SteppingScorer(HFScorerForTests):
    """HFScorerForTests plus a train step (a deterministic parameter move) that records its batches."""

    def __init__(self, checkpoint_dir):
        super().__init__(checkpoint_dir, version=0)
        self.batches = []

    def train_step(self, batch, loss_fn):
        self.batches.append(batch)
        self.fake_step(scale=0.05)
        return {"loss": 0.0}


class Rewards:
    async def score(self, traj):
        await asyncio.sleep(0)
        return SimpleNamespace(reward=float(len(traj.response_ids) % 3), failed=False, reason=None)


def multi_turn_spliced_rows(batch) -> int:
    """Rows with tool tokens between policy tokens and policy tokens of two or more versions."""
    n = 0
    for b in range(batch.size):
        v = batch.versions[b]
        pos = (v != NO_VERSION).nonzero().flatten()
        has_tool = len(pos) > 0 and int(pos[-1] - pos[0]) + 1 > len(pos)
        n += has_tool and len(torch.unique(v[pos])) >= 2
    return n


async def loop_parts(ckpt, run_dir, cfg) -> SimpleNamespace:
    """The loop's trainer, tokenizer, in-process HF engine and its router, buffer, published version and
    recovery context, for config ``cfg`` (tests/unit/test_restart_exactness.py builds its loop with them too)."""
    from megarl.loop.buffer import PublishedVersion, ReplayBuffer
    from megarl.rollout.hf_engine import HFEngine
    from megarl.rollout.router import EngineRouter
    from recovery.base import RecoveryContext

    trainer = SteppingScorer(ckpt)
    engine = await HFEngine.create(str(ckpt), device="cpu")
    buffer, published = ReplayBuffer(cfg.trainer.batch_size, cfg.rollout.eta), PublishedVersion()
    ctx = RecoveryContext(trainer=trainer, live_versions=lambda: buffer.live_versions(published.value),
                          live_trajectories=buffer.live_trajectories, run_dir=str(run_dir), checkpoint_dir=str(ckpt),
                          eta=2)
    return SimpleNamespace(trainer=trainer, tokenizer=run_tokenizer(ckpt), engine=engine,
                           router=EngineRouter([engine]), buffer=buffer, published=published, ctx=ctx)


async def run_loop(name: str, ckpt, run_dir):
    from megarl.builder import load_run_config
    from megarl.data import PromptDataset
    from megarl.loop.controller import Controller
    from megarl.losses.advantages import advantage_fn
    from megarl.rollout.publish import DiskPublisher
    from megarl.workflows import build_workflow
    from recovery.dedicated import Dedicated, DedicatedConfig
    from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
    from recovery.verifier import VerifyingStrategy

    cfg = load_run_config(None, ["rollout.eta=2", "trainer.batch_size=4", "rollout.group_size=2",
                                 "rollout.max_new_tokens=24", "rollout.max_concurrency=16"])
    p = await loop_parts(ckpt, run_dir, cfg)
    trainer, tokenizer, engine, router, buffer, published, ctx = (p.trainer, p.tokenizer, p.engine, p.router,
                                                                  p.buffer, p.published, p.ctx)
    if name == "dedicated":
        inner = Dedicated(DedicatedConfig(scorer_factory="recovery_scorer:make_hf_scorer", start_timeout_s=300,
                                          wait_timeout_s=300), ctx)
    else:
        inner = InterruptSync(InterruptSyncConfig(), ctx)
    strategy = VerifyingStrategy(inner)
    records = []
    c = Controller(
        cfg, trainer=trainer, router=router, buffer=buffer, published=published, rewards=Rewards(),
        dataset=PromptDataset(str(ROOT / "configs/data/reverse_digits_256.jsonl"), tokenizer, seed=0),
        workflow=build_workflow("multi_turn", cfg, tokenizer, max_turns=4), strategy=strategy,
        publisher=DiskPublisher(trainer, router, run_dir / "weights"), loss_fn_factory=lambda b, a: None,
        advantages=advantage_fn(cfg.advantage), on_step=records.append)
    try:
        await asyncio.wait_for(c.train(STEPS), 600)
    finally:
        strategy.close()
        await engine.close()
    return strategy.report(), records, trainer


@pytest.mark.parametrize("name", ["interrupt_sync", "dedicated"])
def test_exact_strategy_with_multi_turn_workflow_under_interruptions(name, ckpt, tmp_path):
    report, records, trainer = asyncio.run(run_loop(name, ckpt, tmp_path))
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert report["claims_exact"] and report["measured_exact"] and report["n_tokens"] > 0
    assert report["max_abs_err"] <= 1e-5, report
    assert sum(r["n_interrupted"] for r in records) > 0
    # what makes this test: trained trajectories with tool output between turns of different versions
    assert sum(multi_turn_spliced_rows(b) for b in trainer.batches) > 0
    assert all(r["staleness_max"] <= 2 for r in records)
    assert not any(math.isnan(x) for b in trainer.batches for x in b.logp_anchor[b.loss_mask > 0].tolist())
