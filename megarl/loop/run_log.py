"""Per-step run outputs: metrics.jsonl, TensorBoard events, optional Weights & Biases, a live progress line, journals.

The progress display draws only on a terminal; when stdout is not one (a
piped or logged run) a plain one-line step summary is printed instead, at the
first step, at most every ``logging.summary_every_s`` seconds and at the last.

TensorBoard and W&B name each metric by its namespace (``actor/``, ``rollout/``,
``timing/``, ``recovery/``, ``eval/``: megarl/loop/metric_names.py); metrics.jsonl
keeps the flat keys. Evaluation results (megarl/loop/evaluation.py) go to metrics.jsonl as lines of
their own (``step`` plus ``eval/...`` keys) and to TensorBoard and W&B under
``eval/``. An evaluation runs in the background and reports at the step it
started, after later steps were logged; W&B drops a row logged with a ``step=``
below its current one, so W&B rows carry their step as a metric instead (``step``
for training, ``eval/step`` for evaluations, each the x-axis of its namespace
through ``define_metric``) and W&B's own counter only orders the rows.
``samples.jsonl`` holds decoded trajectories per step (``logging.log_samples``).

Journals (``write(name, record)``, one JSON line each, flushed): ``accepted.jsonl``
(per accepted group: ``step``, ``accepted_total`` after it, ``group_id``,
``traj_ids``) and ``trained_ids.jsonl`` (per step: ``step``, ``version``,
``skipped``, ``traj_ids``). With them a run shows that no accepted trajectory was
lost or trained twice, across resumes too (megarl/checkpoint/run_checkpoint.py).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from tqdm import tqdm

from megarl.errors import ConfigError
from megarl.loop.metric_names import dashboard_name


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
                 progress: str = "rich", wandb: dict[str, Any] | None = None, summary_every_s: float = 30.0) -> None:
        self.run_dir = Path(run_dir)
        # a progress display draws only on a terminal: a piped or logged run gets plain lines instead
        self._summary_every_s = summary_every_s if not sys.stdout.isatty() else -1.0
        self._last_summary: float | None = None
        self._started = time.monotonic()
        self.total_steps = total_steps
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._file = self.metrics_path.open("a")
        self._journals: dict[str, Any] = {}
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: torch and TensorBoard only when asked for

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        self._wandb_axes: set[str] = set()  # keys given their x-axis with define_metric
        if wandb is not None:
            self._wandb = start_wandb(self.run_dir, **wandb)
        self._bar = None
        if progress == "rich":
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("train", total=total_steps, info="")
            self._bar.start()
        elif progress == "tqdm":
            self._bar = tqdm(total=total_steps, desc="train")

    def log(self, record: dict[str, Any]) -> None:
        record = self._write_scalars(record)
        step = int(record.get("step", 0))
        info = (f"v{record.get('version')} reward {record.get('reward_mean', 0):.3f} "
                f"stale max {record.get('staleness_max')} spliced {record.get('n_spliced')}")
        if isinstance(self._bar, Progress):
            self._bar.update(self._task, completed=step, info=info)  # the step just done, 1-based
        elif self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(info)
        self._summary(step, info)

    def _summary(self, step: int, info: str) -> None:
        """One plain line when stdout is not a terminal: the first step, then at most every
        ``summary_every_s`` seconds, and the last step."""
        if self._summary_every_s < 0:
            return
        now = time.monotonic()
        due = (self._last_summary is None or step >= self.total_steps
               or now - self._last_summary >= self._summary_every_s)
        if due:
            self._last_summary = now
            print(f"step {step}/{self.total_steps} {info} elapsed {now - self._started:.0f}s", flush=True)

    def log_eval(self, record: dict[str, Any]) -> None:
        """An evaluation result: its own metrics.jsonl line, TensorBoard/W&B scalars, and one console line
        (above the progress bar on a terminal)."""
        self._write_scalars(record, wandb_step="eval/step")
        parts = []
        if "eval/pass@1" in record:
            parts.append(f"held-out pass@1 {record['eval/pass@1']:.3f}")
            if "eval/pass@k" in record and "eval/k" in record:
                parts.append(f"pass@{record['eval/k']} {record['eval/pass@k']:.3f}")
        if "eval/reward_mean" in record:
            parts.append(f"reward {record['eval/reward_mean']:.3f}" if parts else
                         f"held-out reward {record['eval/reward_mean']:.3f}")
        if parts:
            prompts = f" ({record['eval/n_prompts']} prompts)" if "eval/n_prompts" in record else ""
            self._say(f"eval at step {record.get('step')}: {', '.join(parts)}{prompts}")

    def _say(self, line: str) -> None:
        if isinstance(self._bar, Progress):
            self._bar.console.print(line, highlight=False)
        elif self._bar is not None:
            tqdm.write(line)
        else:
            print(line, flush=True)

    def _write_scalars(self, record: dict[str, Any], wandb_step: str = "step") -> dict[str, Any]:
        record = _jsonable(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = int(record.get("step", 0))
        # the dashboards get namespaced names (megarl/loop/metric_names.py); metrics.jsonl keeps the flat keys
        scalars = {dashboard_name(k): v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._log_wandb(scalars, step, wandb_step)
        return record

    def _log_wandb(self, scalars: dict[str, Any], step: int, step_key: str) -> None:
        """One W&B row with its step as the metric ``step_key`` (module doc: never W&B's ``step=``)."""
        if step_key not in self._wandb_axes:
            self._wandb.define_metric(step_key)
            self._wandb_axes.add(step_key)
        for k in scalars:
            if k != step_key and k not in self._wandb_axes:
                self._wandb.define_metric(k, step_metric=step_key)
                self._wandb_axes.add(k)
        self._wandb.log({**scalars, step_key: step})

    def write(self, name: str, record: dict[str, Any]) -> None:
        """Append ``record`` to ``RUN_DIR/{name}.jsonl``."""
        f = self._journals.get(name)
        if f is None:
            f = self._journals[name] = (self.run_dir / f"{name}.jsonl").open("a")
        f.write(json.dumps(_jsonable(record), default=str) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._journals.values():
            f.close()
        if self._bar is not None:
            (self._bar.stop if isinstance(self._bar, Progress) else self._bar.close)()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()


def start_wandb(run_dir: Path, project: str, config: dict[str, Any], name: str | None = None):
    """A W&B run in ``run_dir/wandb``: online with WANDB_API_KEY set, offline otherwise (sync it later with
    ``wandb sync``). W&B is optional: without the package, logging.wandb=true is refused before the run."""
    try:
        import wandb  # optional package (not a dependency of megarl)
    except ImportError:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install wandb "
                          "(or set logging.wandb=false)") from None
    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=project, name=name or run_dir.name, dir=str(run_dir), config=config, mode=mode,
                      reinit="finish_previous")
