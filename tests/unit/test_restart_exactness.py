"""Exact recovery on sequences spliced across a restart: a stop mid-run, then a resume in fresh objects.

The loop of tests/unit/test_recovery_multi_turn.py (the real Controller, MultiTurnWorkflow, HF engine in this
process, disk publisher, interrupt_sync inside recovery.verifier.VerifyingStrategy) is stopped after a few
steps: the stop aborts the engine's requests and checkpoints the running groups whole (megarl/loop/running_groups.py).
Everything is then built again from that checkpoint (plain data, as it would come from disk): the trainer's
parameters and version, the strategy's state, the loop's state, an engine loaded with the weights it served.
The resumed run continues the partial trajectories under new versions, so trained rows hold tokens sampled
before the stop and after it; every anchor must match the true logp_old (a forward of each token's own
version's weights) within 1e-5. The verifier's own record of each version's weights is the judge, so it is
handed over; it is not part of the checkpoint. ``rollout.splice_at_tokens`` holds some answers mid-way until a
publish, and the stop is asked for at the first step boundary from STOP_AT on where a running group holds an answer
under way (how far generation has got at a step boundary depends on the machine's load). The negative control
stores a wrong version for the kept tokens of one partial trajectory: the verifier sees it.
"""
import asyncio
import copy
import pickle
import shutil

import pytest
from conftest import ROOT
from recovery_scorer import tiny_checkpoint
from test_recovery_multi_turn import Rewards, loop_parts

from megarl.loop.run_stop import RunStopped

#: the stop comes at the first step from STOP_AT on (at most LAST_STOP) where an answer is under way
STOP_AT, LAST_STOP, STEPS = 5, 7, 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


class KeepState:
    """A checkpointer that keeps the loop's, the strategy's and the trainer's state as plain data."""

    def __init__(self):
        self.state = None
        self.last_step = None

    async def save(self, controller, background=False):
        trainer = controller.trainer
        self.state = pickle.loads(pickle.dumps({
            "loop": controller.state_dict(), "strategy": controller.strategy.state_dict(),
            "params": trainer.get_params(), "trainer_version": trainer.version}))
        self.last_step = controller.step

    async def wait(self):
        return None


async def attempt(ckpt, run_dir, *, resume=None, oracle=None):
    """One attempt of the loop: fresh, stopped after STOP_AT..LAST_STOP steps; or resumed from ``resume`` to
    STEPS."""
    from megarl.builder import load_run_config
    from megarl.data import PromptDataset
    from megarl.loop.controller import Controller
    from megarl.losses.advantages import advantage_fn
    from megarl.rollout.publish import DiskPublisher
    from megarl.workflows import build_workflow
    from recovery.interrupt_sync import InterruptSync, InterruptSyncConfig
    from recovery.verifier import VerifyingStrategy

    cfg = load_run_config(None, ["rollout.eta=2", "trainer.batch_size=4", "rollout.group_size=2",
                                 "rollout.max_new_tokens=24", "rollout.max_concurrency=16", "logging.save_every=0",
                                 "rollout.splice_at_tokens=3"])
    p = await loop_parts(ckpt, run_dir, cfg)
    trainer, engine, router, buffer, published = p.trainer, p.engine, p.router, p.buffer, p.published
    strategy = VerifyingStrategy(InterruptSync(InterruptSyncConfig(), p.ctx))
    records, checkpointer = [], KeepState()
    c = Controller(
        cfg, trainer=trainer, router=router, buffer=buffer, published=published, rewards=Rewards(),
        dataset=PromptDataset(str(ROOT / "configs/data/reverse_digits_256.jsonl"), p.tokenizer, seed=0),
        workflow=build_workflow("multi_turn", cfg, p.tokenizer, max_turns=4), strategy=strategy,
        publisher=DiskPublisher(trainer, router, run_dir / "weights"), loss_fn_factory=lambda b, a: None,
        advantages=advantage_fn(cfg.advantage), on_step=records.append, checkpointer=checkpointer)
    if resume is not None:
        trainer.set_params(resume["params"])
        trainer.version = resume["trainer_version"]
        version = resume["loop"]["version"]
        await engine.update_weights_from_disk(resume["engine_weights"], version)
        strategy.params_by_version.update(oracle)
        strategy.load_state_dict(resume["strategy"])
        c.load_state_dict(resume["loop"], id_prefix="r1.")
        checkpointer.last_step = c.step
    else:
        def on_step(r):
            records.append(r)
            if r["step"] == LAST_STOP or (r["step"] >= STOP_AT and under_way(c)):
                c.request_stop("SIGTERM")

        c.on_step = on_step
    try:
        await asyncio.wait_for(c.train(STEPS), 600)
    except RunStopped:
        pass
    finally:
        strategy.close()
        await engine.close()
    return strategy, records, trainer, checkpointer.state, c


def under_way(c) -> bool:
    """Whether a running group of controller ``c`` holds an answer with tokens, not finished."""
    return any(t.response_ids and not t.finished for g in c.buffer.running_groups.values() for t in g.trajectories)


@pytest.fixture(scope="module")
def stopped(ckpt, tmp_path_factory):
    """Attempt 1, stopped after STOP_AT..LAST_STOP steps: its run directory, verifier and checkpointed state."""
    run_dir = tmp_path_factory.mktemp("run")
    s1, records1, _, state, _ = asyncio.run(attempt(ckpt, run_dir))
    k = state["loop"]["step"]
    assert STOP_AT <= k <= LAST_STOP and [r["step"] for r in records1] == list(range(1, k + 1))
    # the weights the engines served, kept with the checkpoint (the publisher deletes them at its next publish)
    state["engine_weights"] = str(shutil.copytree(run_dir / "weights" / f"v{state['loop']['version']}",
                                                  tmp_path_factory.mktemp("engine_weights") / "w"))
    return run_dir, s1, state


def partial_of(state) -> tuple[dict, set]:
    kept = {t["traj_id"]: t for g in state["loop"]["running_groups"] for t in g["trajectories"]}
    return kept, {k for k, t in kept.items() if t["response_ids"] and not t["finished"]}


def test_exact_recovery_holds_on_sequences_spliced_across_a_stop_and_resume(ckpt, stopped):
    run_dir, s1, state = stopped
    kept, partial = partial_of(state)
    assert partial, "the stop found no trajectory mid-answer"
    s2, records2, trainer2, _, c2 = asyncio.run(attempt(ckpt, run_dir, resume=copy.deepcopy(state),
                                                        oracle=s1.params_by_version))
    assert [r["step"] for r in records2] == list(range(state["loop"]["step"] + 1, STEPS + 1))
    assert sum(r["n_regenerated_after_resume"] for r in records2) == 0
    assert sum(r["n_continued_after_resume"] for r in records2) == len(kept)
    # rows with tokens sampled before the stop and after it, judged against the truth
    spliced = []
    for batch in trainer2.batches:
        for b, tid in enumerate(batch.traj_ids):
            if tid in partial:
                n_kept = sum(kept[tid]["loss_mask"])
                versions = batch.versions[b][batch.loss_mask[b] > 0].tolist()
                assert versions[:n_kept] == [v for v, m in zip(kept[tid]["versions"], kept[tid]["loss_mask"]) if m]
                spliced += [tid] if len(versions) > n_kept else []
    assert spliced, "no trained row went on after the restart"
    report = s2.report()
    assert report["claims_exact"] and report["measured_exact"] and report["n_tokens"] > 0
    assert report["max_abs_err"] <= 1e-5, report


def test_a_wrong_version_stored_for_a_partial_sequence_is_caught(ckpt, stopped):
    """The negative control: one partial trajectory's kept tokens claim the version before their own."""
    run_dir, s1, state = stopped
    state = copy.deepcopy(state)
    kept, partial = partial_of(state)
    t = max((kept[k] for k in partial), key=lambda t: len(t["response_ids"]))
    t["versions"] = [v - 1 if v >= 1 else v for v in t["versions"]]
    s2, *_ = asyncio.run(attempt(ckpt, run_dir, resume=state, oracle=s1.params_by_version))
    report = s2.report()
    assert not report["measured_exact"] and report["max_abs_err"] > 1e-3, report
