"""rollout.batch_invariant reaches the dedicated scorer: its forward runs in the trainer's kernel mode.

The scorer is built three ways (spawned beside the trainer, as a launched role,
or by a ``scorer_factory``); each is checked here with the model builder
replaced by one that records what it was asked for (the batch-invariant
kernels themselves need CUDA).
"""
import inspect
import queue
from pathlib import Path
from types import SimpleNamespace

import pytest
from recovery_scorer import LoopState, tiny_checkpoint

import recovery._dedicated_scorer as scorer_side
import recovery.dedicated as strategy_side
from megarl.trainer import megatron_trainer
from recovery.dedicated import Dedicated, DedicatedConfig

BUILT: list[dict] = []


def recording_factory(checkpoint_dir, **kwargs):
    """A scorer_factory that records its arguments."""
    BUILT.append({"checkpoint_dir": checkpoint_dir, **kwargs})
    return "scorer"


class RecordingTrainer:
    def __init__(self, checkpoint_dir, **kwargs):
        BUILT.append({"checkpoint_dir": checkpoint_dir, **kwargs})


@pytest.fixture(autouse=True)
def _clear():
    BUILT.clear()


def test_build_scorer_passes_the_mode_to_the_model(monkeypatch):
    monkeypatch.setattr(scorer_side, "MegatronTrainer", RecordingTrainer)
    scorer_side._build_scorer("", "/ckpt", "bfloat16", 0.7, False, True)
    scorer_side._build_scorer("", "/ckpt", "bfloat16", 0.7, False, False)
    assert [(b["batch_invariant"], b["forward_only"], b["dtype"], b["temperature"]) for b in BUILT] == [
        (True, True, "bfloat16", 0.7), (False, True, "bfloat16", 0.7)]
    # a factory hears of it when the run asks for it, and is called as before when it does not
    factory = f"{__name__}:recording_factory"
    BUILT.clear()
    scorer_side._build_scorer(factory, "/ckpt", "bfloat16", 0.7, False, True)
    scorer_side._build_scorer(factory, "/ckpt", "bfloat16", 0.7, False, False)
    assert BUILT == [{"checkpoint_dir": "/ckpt", "temperature": 0.7, "batch_invariant": True},
                     {"checkpoint_dir": "/ckpt", "temperature": 0.7}]


def child_args(args: tuple) -> dict:
    """_child_main's arguments by name."""
    return inspect.signature(scorer_side._child_main).bind(*args).arguments


class FakeContext:
    """multiprocessing's spawn context, with a Process that records its target and arguments."""

    def __init__(self):
        self.started = []

    def Queue(self):  # noqa: N802 - multiprocessing's name
        return queue.Queue()

    def Process(self, target, name, daemon, args):  # noqa: N802
        ctx = self

        class Proc:
            def start(self):
                ctx.started.append((target, args))

        return Proc()


def test_the_spawned_scorer_gets_the_trainers_mode(monkeypatch, tmp_path):
    fake = FakeContext()
    monkeypatch.setattr(strategy_side.mp, "get_context", lambda kind: fake)
    monkeypatch.delenv("MEGARL_DEDICATED_ADDR", raising=False)
    for mode in (True, False):
        trainer = SimpleNamespace(dtype="bfloat16", temperature=1.0, allow_local_spec=False, batch_invariant=mode)
        strat = Dedicated(DedicatedConfig(), LoopState().context(trainer, run_dir=tmp_path, checkpoint_dir="/ckpt"))
        strat._start()
        strat._link._closing.set()  # ends the link's reader thread; there is no child to hear from
    assert [target for target, _ in fake.started] == [scorer_side._child_main] * 2
    assert [child_args(args)["batch_invariant"] for _, args in fake.started] == [True, False]


def test_the_scorer_role_gets_the_runs_mode(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    built = []
    conn = SimpleNamespace(send=print)
    monkeypatch.setattr(scorer_side, "_own_world", lambda env: None)  # keep this process's environment
    monkeypatch.setattr(scorer_side, "_build_scorer", lambda *a: built.append(a) or "scorer")
    monkeypatch.setattr(scorer_side, "_serve", lambda scorer, recv, send: None)
    monkeypatch.setattr(scorer_side.listening, "listen", lambda port, host: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(scorer_side.listening, "accept_in_background",
                        lambda listener, key, warn, *a, **kw: SimpleNamespace(get=lambda: conn))
    monkeypatch.setattr(scorer_side.listening, "reader", lambda c, *a: None)
    monkeypatch.setattr(scorer_side.link, "hang_up", lambda c: None)
    run_cfg = SimpleNamespace(recovery=SimpleNamespace(name="dedicated", options={}),
                              model=SimpleNamespace(checkpoint=str(tmp_path), dtype="bfloat16", allow_local_spec=False),
                              rollout=SimpleNamespace(temperature=1.0, batch_invariant=True))
    scorer_side.serve_role(run_cfg, 1, b"k")
    assert built == [("", str(tmp_path), "bfloat16", 1.0, False, True, DedicatedConfig().micro_batch_tokens)]


def test_the_trainer_says_its_mode(monkeypatch, tmp_path):
    """The strategy reads the mode off the trainer (ctx.trainer.batch_invariant): the trainer keeps it."""
    ckpt = tiny_checkpoint(Path(tmp_path) / "ckpt")
    switched = []
    monkeypatch.setattr(megatron_trainer, "enable_in_trainer", switched.append)  # the CUDA kernels: not on CPU
    trainer = megatron_trainer.MegatronTrainer(str(ckpt), batch_invariant=True, forward_only=True)
    assert trainer.batch_invariant is True and switched == [trainer.config]
