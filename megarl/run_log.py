"""Per-step run outputs: metrics.jsonl, TensorBoard events, a live progress line, and id journals.

Journals (``write(name, record)``, one JSON line each, flushed): ``accepted.jsonl``
(per accepted group: ``step``, ``accepted_total`` after it, ``group_id``,
``traj_ids``) and ``trained_ids.jsonl`` (per step: ``step``, ``version``,
``skipped``, ``traj_ids``). With them a run shows that no accepted trajectory was
lost or trained twice, across resumes too (megarl/checkpoint.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if hasattr(v, "item"):
        return v.item()
    return v


class RunLogger:
    """Writes one JSON line per step and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: str | Path, total_steps: int, tensorboard: bool = True,
                 progress: str = "rich") -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._file = self.metrics_path.open("a")
        self._journals: dict[str, Any] = {}
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._bar = None
        if progress == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("train", total=total_steps, info="")
            self._bar.start()
        elif progress == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train")

    def log(self, record: dict[str, Any]) -> None:
        record = _jsonable(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = int(record.get("step", 0))
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        info = (f"v{record.get('version')} reward {record.get('reward_mean', 0):.3f} "
                f"stale max {record.get('staleness_max')} spliced {record.get('n_spliced')}")
        if self._bar is not None and hasattr(self._bar, "update") and hasattr(self, "_task"):
            self._bar.update(self._task, completed=step + 1, info=info)
        elif self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(info)

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Append ``record`` to ``RUN_DIR/{name}.jsonl``."""
        f = self._journals.get(name)
        if f is None:
            f = self._journals[name] = (self.run_dir / f"{name}.jsonl").open("a")
        f.write(json.dumps(_jsonable(record)) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._journals.values():
            f.close()
        if self._bar is not None:
            (self._bar.stop if hasattr(self._bar, "stop") else self._bar.close)()
        if self._tb is not None:
            self._tb.close()
        self._file.close()
