"""Prompt datasets: rows of problems, turned into token ids by the run's tokenizer; an endless, resumable stream.

Sources (``data.path``):

- a ``.jsonl`` file (one JSON object per line) or a ``.parquet`` file (the
  format of verl's data files);
- ``hf:NAME``, ``hf:NAME:SPLIT`` or ``hf:NAME:CONFIG:SPLIT`` (default split
  ``train``): a Hugging Face ``datasets`` dataset (a hub name, or a local
  directory of data files).

A row holds its prompt under ``data.prompt_key`` (default ``prompt``): a
string, or a list of chat messages ``[{"role", "content"}, ...]``; both go
through the tokenizer's chat template (megarl/tokenizer.py). Rows may instead
hold pre-tokenized ``prompt_ids`` (a list of ints). The ground truth sits under
``data.answer_key`` (default ``answer``); a row whose ground truth is
``null`` is refused, naming it (a row without one cannot be scored). Both keys may be dotted paths into
nested fields (``reward_model.ground_truth``). The row's fields (the prompt as
written included) travel with the prompt to the reward and to an agent. An ``id`` field names the prompt
(default ``FILE:LINE`` / ``NAME:SPLIT:ROW``).

Everything is read, rendered and checked when the dataset is built, so a bad
row fails before the run starts, naming the file, the line and the key.
Prompts longer than ``data.max_prompt_len`` tokens are filtered out with a
warning and a count (``data.on_overlong=filter``) or refused (``error``).
The rows repeat in epochs, each shuffled by ``(seed, epoch)``;
``state_dict()`` is the stream position, and loading it continues at the same prompt.
"""
from __future__ import annotations

import copy
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from megarl.config.input_paths import where_looked
from megarl.errors import ConfigError, InputError

log = logging.getLogger("megarl.data")

#: what :func:`get_dotted` returns for a field the row does not have
MISSING = object()


@dataclass
class Prompt:
    """One prompt of the stream: its token ids, its ground truth and the rest of its row."""

    prompt_id: str
    prompt_ids: list[int]
    answer: Any = None
    #: the row's fields, the prompt as written included (the reward gets them as ``row``, an agent as its row)
    row: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "prompt_ids": list(self.prompt_ids), "answer": self.answer,
                "row": self.row}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Prompt":
        return cls(d["prompt_id"], list(d["prompt_ids"]), d.get("answer"), dict(d.get("row") or {}))


def get_dotted(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, where ``a.b`` reaches ``row["a"]["b"]`` (a literal key with dots wins); MISSING if absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def read_rows(source: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(where, default id, row)`` for every row of a JSONL/Parquet file or an ``hf:`` dataset.

    ``where`` names the row in errors (the whole path); the default id (``NAME:LINE``) does not depend on
    where the file lies, so a resumed run on another machine sees the same prompt ids.
    """
    if source.startswith("hf:"):
        yield from _hf_rows(source[len("hf:"):])
        return
    path = Path(source)
    if not path.is_file():
        raise InputError(f"data file {path} does not exist (expected a .jsonl or .parquet file, or hf:NAME[:SPLIT])"
                         f"{where_looked(source)}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional package, only for .parquet data

            rows = pq.read_table(path).to_pylist()
        except ImportError:
            raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
        except Exception as e:  # not a Parquet file, truncated, ...
            raise InputError(f"cannot read {path} as Parquet: {type(e).__name__}: {e}") from None
        for i, row in enumerate(rows):
            yield f"{path} row {i}", f"{path.name}:{i}", row
        return
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read data file {path}: {e}") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise InputError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            yield where, f"{path.name}:{lineno}", row


def _hf_rows(spec: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    try:
        import datasets  # optional (and heavy) package, only for hf: data
    except ImportError:
        raise ConfigError(f"data.path 'hf:{spec}' needs the Hugging Face `datasets` package: "
                          f"pip install datasets") from None
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ConfigError(f"data.path 'hf:{spec}': expected hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    name = parts[0]
    config = parts[1] if len(parts) == 3 else None
    split = parts[-1] if len(parts) > 1 else "train"
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, missing dataset or split: all fatal before the run
        raise InputError(f"cannot load Hugging Face dataset {name!r} split {split!r}: {type(e).__name__}: {e}") from e
    for i, row in enumerate(rows):
        yield f"hf:{spec} row {i}", f"hf:{spec}:{i}", dict(row)


def prompt_stream(source: Any) -> Callable[[], Awaitable[Any]]:
    """An async ``next`` over the run's prompts: the source's own (one that waits for prompts, e.g. the rows an
    agent service posts, megarl/agents/service_rows.py) or one over an iterator (a :class:`PromptDataset`)."""
    if callable(getattr(source, "next", None)):
        return source.next
    it = iter(source)

    async def next_prompt() -> Any:
        return next(it)
    return next_prompt


def check_row(where: str, row: dict[str, Any], prompt_key: str, answer_key: str,
              vocab_size: int | None = None) -> tuple[Any, list[int] | None, Any]:
    """A row's prompt as written (or None), its pre-tokenized ``prompt_ids`` (or None) and its ground truth;
    InputError naming ``where`` and the missing or malformed key."""
    prompt, ids = get_dotted(row, prompt_key), None
    if prompt is MISSING and "prompt_ids" in row:
        prompt, ids = None, PromptDataset._check_ids(where, row["prompt_ids"], vocab_size)
    elif prompt is MISSING:
        raise InputError(f"{where}: no field {prompt_key!r} (data.prompt_key) and no 'prompt_ids'; "
                         f"fields: {sorted(row)[:12]}")
    elif not isinstance(prompt, (str, list)):
        raise InputError(f"{where}: field {prompt_key!r} must be a string or a list of chat messages, "
                         f"got {type(prompt).__name__}")
    answer = None
    if answer_key:
        answer = get_dotted(row, answer_key)
        if answer is MISSING:
            raise InputError(f"{where}: no field {answer_key!r} (data.answer_key) holding the ground truth; "
                             f"set data.answer_key to the right field, or to '' if rows have no answer")
        if answer is None:  # every sample of the row would fail its reward or score a silent 0
            raise InputError(f"{where}: field {answer_key!r} (data.answer_key) is null; give the row its "
                             f"ground truth or remove it from the data")
    return prompt, ids, answer


class PromptDataset:
    """Endless prompt stream over the rows of ``source`` (module docstring)."""

    def __init__(self, source: str, tokenizer: Any, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 max_prompt_len: int | None = None, on_overlong: str = "filter", seed: int = 0,
                 shuffle: bool = True, vocab_size: int | None = None) -> None:
        if on_overlong not in ("filter", "error"):
            raise ConfigError(f"data.on_overlong={on_overlong!r}; choose filter or error")
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._index = 0  # next position within the epoch
        self.n_filtered = 0  # prompts dropped for being longer than max_prompt_len
        self._prompts = self._load(source, tokenizer, prompt_key, answer_key, max_prompt_len, on_overlong,
                                   vocab_size)
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, data_cfg: Any, tokenizer: Any, seed: int = 0, vocab_size: int | None = None,
                    path: str | None = None, shuffle: bool | None = None) -> "PromptDataset":
        """From a ``DataConfig`` (``path``/``shuffle`` override its own: the evaluation set uses the data keys)."""
        source = data_cfg.path if path is None else path
        if not source:
            raise ConfigError("data.path is empty; set it to a .jsonl or .parquet file of prompts, or hf:NAME[:SPLIT] "
                              "(README, section Data)")
        return cls(source, tokenizer, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
                   max_prompt_len=data_cfg.max_prompt_len, on_overlong=data_cfg.on_overlong, seed=seed,
                   shuffle=data_cfg.shuffle if shuffle is None else shuffle, vocab_size=vocab_size)

    # -- loading and validation --------------------------------------------------
    def _load(self, source, tokenizer, prompt_key, answer_key, max_len, on_overlong, vocab_size) -> list[Prompt]:
        seen: dict[str, str] = {}
        wheres: list[str] = []
        pids: list[str] = []
        answers: list[Any] = []
        rests: list[dict[str, Any]] = []
        ids: list[list[int] | None] = []
        texts: dict[int, str] = {}  # row index -> rendered text, for rows that are not pre-tokenized
        for where, default_id, row in read_rows(source):
            prompt, p_ids, answer = check_row(where, row, prompt_key, answer_key, vocab_size)
            if p_ids is None:
                texts[len(ids)] = tokenizer.render(prompt, where)
            ids.append(p_ids)
            pid = str(row["id"]) if row.get("id") is not None else default_id
            if pid in seen:
                raise InputError(f"{where}: duplicate id {pid!r} (first at {seen[pid]}); prompt ids must be unique")
            seen[pid] = where
            rests.append({k: v for k, v in row.items() if k != "prompt_ids"})
            wheres.append(where)
            pids.append(pid)
            answers.append(answer)
        if not ids:
            raise InputError(f"data source {source} is empty: it has no rows")
        order = sorted(texts)
        for i, enc in zip(order, tokenizer.encode_rendered([texts[i] for i in order])):
            ids[i] = enc
        prompts: list[Prompt] = []
        longest = 0
        for where, pid, p_ids, answer, rest in zip(wheres, pids, ids, answers, rests):
            if max_len is not None and len(p_ids) > max_len:
                if on_overlong == "error":
                    raise InputError(f"{where}: prompt has {len(p_ids)} tokens, longer than data.max_prompt_len="
                                     f"{max_len}; raise it or set data.on_overlong=filter")
                self.n_filtered += 1
                longest = max(longest, len(p_ids))
                continue
            prompts.append(Prompt(pid, p_ids, answer, rest))
        if not prompts:
            raise InputError(f"every prompt of {source} ({len(ids)}) is longer than data.max_prompt_len={max_len} "
                             f"tokens (the longest has {longest}); raise data.max_prompt_len")
        if self.n_filtered:
            log.warning("%s: %d of %d prompts are longer than data.max_prompt_len=%d tokens and were filtered out "
                        "(the longest has %d)", source, self.n_filtered, len(ids), max_len, longest)
        return prompts

    @staticmethod
    def _check_ids(where: str, prompt_ids: Any, vocab_size: int | None) -> list[int]:
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise InputError(f"{where}: 'prompt_ids' must be a non-empty list of token ids, got {prompt_ids!r:.80}")
        if vocab_size is not None:
            bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return list(prompt_ids)

    # -- streaming -----------------------------------------------------------------
    @property
    def size(self) -> int:
        """Prompts per epoch."""
        return len(self._prompts)

    def __len__(self) -> int:
        return len(self._prompts)

    def prompts(self) -> list[Prompt]:
        """All prompts in file order (evaluation goes over each of them)."""
        return [copy.deepcopy(p) for p in self._prompts]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        if self._index >= len(self._order):
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order(self._epoch)
        p = self._prompts[self._order[self._index]]
        self._index += 1
        # a copy, so a workflow that edits the row does not change the next epoch's prompt
        return copy.deepcopy(p)

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
