"""Prompt datasets: an endless, resumable stream of prompts for the controller.

Sources (the ``source`` string):

- a built-in task name (``"reverse_digits"``): an infinite seeded generator;
  prompt i is drawn from its own RNG, so the stream is the same on every run.
- ``"hf:NAME"`` or ``"hf:NAME:SPLIT"`` (default split ``train``): a Hugging Face
  ``datasets`` dataset (needs ``pip install datasets``). Rows must already be
  tokenized: a ``prompt_ids`` column (list of ints), optional ``meta`` (dict)
  and ``id`` columns. Tokenizing a text ``prompt_key`` column is out of scope.
- anything else: a JSONL file, one prompt per line
  ``{"prompt_ids": [...], "meta": {...}, "id": "..."}`` (``meta``, ``id`` optional).

Finite sources are read and validated completely when the dataset is built,
so a bad line fails before the run starts, not hours into it. They repeat in
epochs, each shuffled by ``(seed, epoch)``. Every prompt has a stable
``prompt_id`` (its ``id``, else ``FILE:LINE`` / ``NAME:SPLIT:ROW`` / ``TASK/SEED/INDEX``).
``state_dict()`` is the stream position; loading it continues at the same prompt.
"""
from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megarl.errors import ConfigError, InputError
from megarl.tasks import TASKS, get_task


@dataclass
class Prompt:
    """One prompt of the stream."""

    prompt_id: str
    prompt_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


class PromptDataset:
    """Endless prompt stream from a task, a JSONL file or a HF dataset (module docstring)."""

    def __init__(self, source: str, *, max_prompt_len: int | None = None, seed: int = 0,
                 shuffle: bool = True, vocab_size: int | None = None) -> None:
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.max_prompt_len = max_prompt_len
        self.vocab_size = vocab_size
        self._epoch = 0
        self._index = 0  # next position within the epoch (finite) or in the stream (task)
        self._prompts: list[Prompt] | None = None
        self._task = None
        if source in TASKS:
            self._task = get_task(source)
            if max_prompt_len is not None and self._task.MAX_PROMPT_LEN > max_prompt_len:
                raise InputError(f"task {source!r} makes prompts of up to {self._task.MAX_PROMPT_LEN} tokens, "
                                 f"longer than max_prompt_len={max_prompt_len}")
        elif source.startswith("hf:"):
            self._prompts = self._load_hf(source[len("hf:"):])
        else:
            self._prompts = self._load_jsonl(Path(source))
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, data_cfg: Any, seed: int = 0, vocab_size: int | None = None) -> "PromptDataset":
        """Build from a ``DataConfig``: ``path`` if set, else ``hf_dataset``, else the built-in ``task``."""
        if data_cfg.path and data_cfg.hf_dataset:
            raise ConfigError(f"data.path={data_cfg.path!r} and data.hf_dataset={data_cfg.hf_dataset!r} "
                              f"are both set; choose one")
        source = data_cfg.path or (f"hf:{data_cfg.hf_dataset}" if data_cfg.hf_dataset else data_cfg.task)
        return cls(source, max_prompt_len=data_cfg.max_prompt_len, seed=seed, vocab_size=vocab_size)

    # -- loading and validation --------------------------------------------------
    def _check(self, where: str, prompt_ids: Any, meta: Any) -> tuple[list[int], dict[str, Any]]:
        """Validate one record; ``where`` names it (file and line) in the error."""
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise InputError(f"{where}: 'prompt_ids' must be a non-empty list of token ids, got {prompt_ids!r:.80}")
        if self.max_prompt_len is not None and len(prompt_ids) > self.max_prompt_len:
            raise InputError(f"{where}: prompt has {len(prompt_ids)} tokens, longer than "
                             f"max_prompt_len={self.max_prompt_len}")
        if self.vocab_size is not None:
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InputError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise InputError(f"{where}: 'meta' must be an object, got {type(meta).__name__}")
        return prompt_ids, meta

    @staticmethod
    def _claim_id(seen: dict[str, str], where: str, pid: str) -> None:
        if pid in seen:
            raise InputError(f"{where}: duplicate id {pid!r} (first at {seen[pid]}); prompt ids must be unique")
        seen[pid] = where

    def _load_jsonl(self, path: Path) -> list[Prompt]:
        if not path.is_file():
            raise InputError(f"prompt file {path} does not exist (and {path.name!r} is not a built-in task: "
                             f"{sorted(TASKS)}; use 'hf:NAME' for a Hugging Face dataset)")
        prompts: list[Prompt] = []
        seen: dict[str, str] = {}
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(rec, dict) or "prompt_ids" not in rec:
                    raise InputError(f"{where}: expected an object with 'prompt_ids' (and optional 'meta', 'id')")
                prompt_ids, meta = self._check(where, rec["prompt_ids"], rec.get("meta"))
                pid = str(rec["id"]) if rec.get("id") is not None else f"{path.name}:{lineno}"
                self._claim_id(seen, where, pid)
                prompts.append(Prompt(pid, prompt_ids, meta))
        if not prompts:
            raise InputError(f"prompt file {path} has no prompts")
        return prompts

    def _load_hf(self, spec: str) -> list[Prompt]:
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"source 'hf:{spec}' needs the Hugging Face `datasets` package: "
                              f"pip install datasets") from None
        name, _, split = spec.partition(":")
        split = split or "train"
        try:
            rows = datasets.load_dataset(name, split=split)
        except Exception as e:  # network, missing dataset or split: all fatal before the run
            raise InputError(f"cannot load Hugging Face dataset {name!r} split {split!r}: {e}") from e
        prompts: list[Prompt] = []
        seen: dict[str, str] = {}
        for row_no, row in enumerate(rows):
            where = f"hf:{name}:{split} row {row_no}"
            if "prompt_ids" not in row:
                raise InputError(f"{where}: no 'prompt_ids' column; hf datasets must be pre-tokenized")
            prompt_ids, meta = self._check(where, list(row["prompt_ids"]), row.get("meta"))
            pid = str(row["id"]) if row.get("id") is not None else f"{name}:{split}:{row_no}"
            self._claim_id(seen, where, pid)
            prompts.append(Prompt(pid, prompt_ids, meta))
        if not prompts:
            raise InputError(f"Hugging Face dataset {name!r} split {split!r} has no rows")
        return prompts

    # -- streaming -----------------------------------------------------------------
    @property
    def size(self) -> int | None:
        """Prompts per epoch; None for an infinite task generator."""
        return None if self._prompts is None else len(self._prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._prompts is None:
            return []
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        if self._prompts is None:
            i = self._index
            self._index += 1
            prompt_ids, meta = self._task.make_prompt(self._task.prompt_rng(self.seed, i))
            return Prompt(f"{self.source}/{self.seed}/{i}", prompt_ids, meta)
        if self._index >= len(self._order):
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order(self._epoch)
        p = self._prompts[self._order[self._index]]
        self._index += 1
        # a copy, so a workflow that edits meta does not change the next epoch's prompt
        return Prompt(p.prompt_id, list(p.prompt_ids), copy.deepcopy(p.meta))

    # -- resume --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source, "seed": self.seed, "size": self.size,
                "epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the position of ``state``; refuses a different source, seed or size."""
        mine = (self.source, self.seed, self.size)
        theirs = (state.get("source"), state.get("seed"), state.get("size"))
        if mine != theirs:
            raise ConfigError(f"dataset state is for (source, seed, size)={theirs}, this dataset is {mine}; "
                              f"resuming would replay or skip prompts")
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self._epoch)
