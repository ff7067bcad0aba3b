"""Each trainer rank's part of a run checkpoint: the trainer's (trainer/) and the strategy's (strategy/) state.

Saved reshardable (megarl/trainer/dist_state.py, megarl/trainer/param_state.py), loaded into the run's own layout;
the rest of the checkpoint is megarl/checkpoint/run_checkpoint.py's.
"""
from __future__ import annotations

from pathlib import Path

from megarl.checkpoint.writer import torch_save_errors
from megarl.trainer.dist_state import STATE_FILE, load_reshardable, prepare_reshardable
from megarl.trainer.param_state import load_strategy_state, prepare_strategy_state


def prepare_rank_state(step_dir: str | Path, trainer, strategy_state: dict, *, background: bool = False):
    """Prepare this rank's trainer (trainer/) and strategy (strategy/) state; a collective of every rank. Returns
    ``write(group)``, which writes them (megarl/checkpoint/writer.py: in the background over the checkpoint group)."""
    step_dir = Path(step_dir)
    # torch's CheckpointException is a BaseException: made a CheckpointError here
    with torch_save_errors(f"the trainer's state in {step_dir}", str(step_dir)):
        trainer_write = prepare_reshardable(trainer, str(step_dir / "trainer"), background=background)
        strategy_write = prepare_strategy_state(trainer, strategy_state, str(step_dir / "strategy"),
                                                background=background)

    def write(group) -> None:
        with torch_save_errors(f"the trainer's state in {step_dir}", str(step_dir)):
            trainer_write(group)
            strategy_write(group)

    return write


def save_rank_state(step_dir: str | Path, trainer, strategy_state: dict) -> None:
    """The trainer's (trainer/) and the strategy's (strategy/) state, reshardable, now; a collective of every rank."""
    prepare_rank_state(step_dir, trainer, strategy_state)(None)


def load_rank_state(step_dir: str | Path, trainer, strategy) -> None:
    """Inverse of :func:`save_rank_state` into this run's layout (a per-rank checkpoint: the same layout only)."""
    step_dir = Path(step_dir)
    load_reshardable(trainer, str(step_dir / "trainer"))
    strategy.load_state_dict(load_strategy_state(trainer, str(step_dir / "strategy")))


def is_reshardable(step_dir: str | Path) -> bool:
    """Whether the checkpoint's trainer state is the layout-free one (a resume may change TP/PP/EP/DP)."""
    return (Path(step_dir) / "trainer" / STATE_FILE).is_file()


class SingleRankStates:
    """The trainer's and strategy's files of a run with one trainer rank: this process writes and reads them.

    With several ranks :class:`~megarl.loop.spmd.DrivingTrainer` takes its place: every rank does its own.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def save_rank_states(self, step_dir: str, strategy_state: dict) -> None:
        save_rank_state(step_dir, self.trainer, strategy_state)

    def prepare_rank_states(self, step_dir: str, strategy_state: dict):
        return prepare_rank_state(step_dir, self.trainer, strategy_state, background=True)

    def load_rank_states(self, step_dir: str, strategy) -> None:
        load_rank_state(step_dir, self.trainer, strategy)
