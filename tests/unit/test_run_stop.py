"""A run that stops early leaves a checkpoint of the step it reached: on a stop request (SIGTERM/SIGINT),
when the train step or the rollout loop fails, and on the time schedule (logging.save_every_s).

The loop, buffer and checkpoint capture are the real ones (tests/unit/test_checkpoint.py's simulated
engine and step-counting trainer); the real CLI under SIGTERM is tests/e2e/test_resume.py's.
"""
import asyncio

import pytest
from loop_fixtures import make_controller

import megarl.loop.run_stop as run_stop
from megarl.builder import load_run_config
from megarl.errors import InputError, TrainingError
from megarl.loop.run_stop import EXIT_STOPPED, RunStopped


def trained_ids(trainer, upto=None):
    return [i for _, _, ids in trainer.trained[:upto] for i in ids]


def test_a_stop_request_checkpoints_the_step_reached_and_the_resume_continues():
    c1, t1, ck1, _ = make_controller(0)  # save_every=3
    inner = t1.train_step

    async def main():
        loop = asyncio.get_running_loop()

        def train_step(batch, loss_fn):  # the signal comes while step 4 trains: that step finishes
            if t1.version == 3:
                loop.call_soon_threadsafe(c1.request_stop, "SIGTERM")
            return inner(batch, loss_fn)

        t1.train_step = train_step
        await c1.train(40)

    with pytest.raises(RunStopped, match=r"stopped by SIGTERM at step 4") as err:
        asyncio.run(asyncio.wait_for(main(), 60))
    assert err.value.exit_code == EXIT_STOPPED == 75
    assert sorted(ck1.saved) == [3, 4] and c1.step == 4
    state = ck1.saved[4]
    assert state["trainer_version"] == 4 and state["version"] == 3, "the stopping step's publish is left to the resume"

    c2, t2, _, _ = make_controller(100, state)
    asyncio.run(asyncio.wait_for(c2.train(8), 60))
    assert [v for v, _, _ in t2.trained] == [4, 5, 6, 7], "versions continue without a gap"
    trained = trained_ids(t1) + trained_ids(t2)
    assert len(trained) == len(set(trained)) == 8 * 8, "a trajectory was trained twice"


def test_a_stop_request_abandons_the_wait_for_a_batch():
    c, _, ck, _ = make_controller(1)

    async def never(req):
        await asyncio.Event().wait()

    c.router.generate = never  # no group ever finishes: the trainer waits for its first batch

    async def main():
        asyncio.get_running_loop().call_later(0.2, c.request_stop, "SIGINT")
        await c.train(10)

    with pytest.raises(RunStopped, match="stopped by SIGINT at step 0"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert sorted(ck.saved) == [0] and ck.saved[0]["trainer_version"] == 0


def test_a_failing_train_step_checkpoints_the_step_reached_first():
    c, trainer, ck, _ = make_controller(2)
    inner = trainer.train_step

    def train_step(batch, loss_fn):
        if trainer.version == 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return inner(batch, loss_fn)

    trainer.train_step = train_step
    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(asyncio.wait_for(c.train(40), 60))
    assert sorted(ck.saved) == [3, 4]
    state = ck.saved[4]
    assert state["step"] == 4 and state["trainer_version"] == 4
    # the failed step's batch of 8 left the gate's count, as a skipped step's does
    assert state["buffer"]["released_total"] == 8


def test_a_fatal_rollout_error_checkpoints_the_step_reached_first():
    c, _, ck, _ = make_controller(3)
    c.cfg.logging.save_every = 0
    c.cfg.logging.save_every_s = 0.0
    good = c.router.generate

    async def refusing(req):
        if c.step >= 5:
            await asyncio.sleep(0)
            raise InputError(f"request {req.request_id}: prompt too long")
        return await good(req)

    c.router.generate = refusing
    with pytest.raises(TrainingError, match="groups in a row failed in generation"):
        asyncio.run(asyncio.wait_for(c.train(40), 60))
    assert c.step >= 5 and sorted(ck.saved) == [c.step]
    assert ck.saved[c.step]["trainer_version"] == c.step


def test_checkpoints_follow_the_clock(monkeypatch):
    c, _, ck, _ = make_controller(4)
    c.cfg.logging.save_every = 0
    c.cfg.logging.save_every_s = 1800.0
    monkeypatch.setattr(run_stop, "_now", lambda: c.step * 700.0)  # each step takes 700 s
    asyncio.run(asyncio.wait_for(c.train(8), 60))
    # 2100 s after the start at step 3, 2100 s after that at step 6, and the end
    assert sorted(ck.saved) == [3, 6, 8]


def test_a_run_checkpoints_every_half_hour_by_default():
    assert load_run_config(None, []).logging.save_every_s == 1800.0
