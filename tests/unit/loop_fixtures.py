"""The real loop (Controller, ReplayBuffer) around the gate tests' simulators, for checkpoint and stop tests.

The engine keeps its own log of what it was asked and what it returned
(:class:`RecordingEngine`), and the checkpointer notes where in that log each
checkpoint was cut: an account of the work, kept outside the loop's own
journal and checkpoint, that a resumed run's trainings can be checked against.
"""
import copy
import functools
import pickle
import random
import tempfile
import time
from pathlib import Path

from conftest import ROOT, run_tokenizer, write_tokenizer
from test_staleness_gate import SimulatedEngineForGateTests


class StateTrainer:
    """The gate tests' step counter, plus save/load of its version; ``delay_s`` more per step (in the loop's
    worker thread: generation goes on meanwhile) lets the engine run ahead and fill the buffer."""

    def __init__(self, rng, delay_s=0.0):
        from test_staleness_gate import StepCounterTrainerForGateTests

        self.inner = StepCounterTrainerForGateTests(rng)
        self.delay_s = delay_s

    @property
    def version(self):
        return self.inner.version

    @property
    def trained(self):
        return self.inner.trained

    @property
    def last_skip_reason(self):
        return self.inner.last_skip_reason

    def train_step(self, batch, loss_fn):
        time.sleep(self.delay_s)
        return self.inner.train_step(batch, loss_fn)


class RecordingEngine(SimulatedEngineForGateTests):
    """The simulated engine with a log of its own: ``("start", traj_id, prompt_ids)`` when a request comes in
    (a resubmission's prompt holds the partial answer), ``("end", traj_id, versions, finish_reason)`` when it
    returns. The trajectory is the first part of the request id (``{traj_id}/{tokens so far}/{chunk}``)."""

    def __init__(self, rng, max_len):
        super().__init__(rng, max_len)
        self.log: list[tuple] = []

    async def generate(self, req):
        traj_id = req.request_id.split("/")[0]
        self.log.append(("start", traj_id, tuple(req.prompt_ids)))
        res = await super().generate(req)
        self.log.append(("end", traj_id, list(res.versions), res.finish_reason))
        return res


class CapturingCheckpointer:
    def __init__(self):
        self.saved: dict[int, dict] = {}
        #: step -> length of the engine's log when that step's checkpoint was cut
        self.cuts: dict[int, int] = {}
        self.last_step = None

    async def save(self, controller, background=False):
        """Cuts at once, also when the schedule asks for a background write (it has nothing to wait for)."""
        self.saved[controller.step] = pickle.loads(pickle.dumps(controller.state_dict()))
        self.saved[controller.step]["trainer_version"] = controller.trainer.version
        self.cuts[controller.step] = len(getattr(controller.router, "log", ()))
        self.last_step = controller.step

    async def wait(self):
        return None


class Journal:
    def __init__(self):
        self.lines: dict[str, list] = {"accepted": [], "trained_ids": []}

    def write(self, name, record):
        self.lines[name].append(copy.deepcopy(record))


@functools.lru_cache(maxsize=1)
def _tokenizer_dir():
    return write_tokenizer("configs/models/tiny_qwen3.yaml", Path(tempfile.mkdtemp(prefix="megarl-tok-")))


def make_controller(seed, steps_state=None, eta=2, checkpointer=None, overrides=(), train_delay_s=0.0,
                    workflow=None):
    """A controller over the simulators (batch 8, groups of 4, a checkpoint every 3 steps); with
    ``steps_state`` (a CapturingCheckpointer state), resumed from it as attempt ``r1.``. ``workflow``: the gate
    tests' single turn by default (it cannot continue an answer a restart cut)."""
    from test_staleness_gate import Rewards, SingleTurn

    from megarl.builder import load_run_config
    from megarl.data import PromptDataset
    from megarl.loop.buffer import PublishedVersion, ReplayBuffer
    from megarl.loop.controller import Controller
    from recovery.base import RecoveryContext
    from recovery.behav import Behav

    rng = random.Random(seed)
    cfg = load_run_config(None, [f"rollout.eta={eta}", "trainer.batch_size=8", "rollout.group_size=4",
                                 "logging.save_every=3", *overrides])
    engine = RecordingEngine(rng, 12)
    trainer = StateTrainer(rng, train_delay_s)

    class Publisher:
        async def prepare(self, version):
            pass

        async def apply(self, version):
            engine.version = version

    def advantages(trajs):
        for t in trajs:
            t.advantage = 0.0

    checkpointer, journal = checkpointer or CapturingCheckpointer(), Journal()
    c = Controller(cfg, trainer=trainer, router=engine, buffer=ReplayBuffer(cfg.trainer.batch_size, eta),
                   published=PublishedVersion(),
                   rewards=Rewards(),
                   dataset=PromptDataset(str(ROOT / "configs/data/reverse_digits_256.jsonl"),
                                         run_tokenizer(_tokenizer_dir()), seed=0), workflow=workflow or SingleTurn(),
                   strategy=Behav(None, RecoveryContext(trainer=trainer)), publisher=Publisher(),
                   loss_fn_factory=lambda b, a: None, advantages=advantages, on_step=lambda r: None,
                   checkpointer=checkpointer, journal=journal)
    if steps_state is not None:
        trainer.inner.version = steps_state["trainer_version"]
        engine.version = steps_state["version"]
        c.load_state_dict(steps_state, id_prefix="r1.")
        checkpointer.last_step = c.step
    return c, trainer, checkpointer, journal
