"""Rows that a long-lived agent service brings (``agent.rows_from_service``): the run's prompts come from
``POST /sessions {"row": {...}}`` instead of ``data.path``.

A posted row is checked like a row of a data file (``data.prompt_key``,
``data.answer_key``, ``data.max_prompt_len``; a bad row gets 400 naming what is
wrong) and queued. The rollout loop takes rows from here (:meth:`ServiceRows.next`)
only when the staleness gate admits a group, so the request waits while the
gate is closed (backpressure) and, past ``agent.row_wait_s``, is answered 503
with ``Retry-After``; its row is then not rolled out. An admitted row is rolled
out as one group of ``rollout.group_size`` episodes, and the request is answered
with their keys. Its prompt id is ``service:<n>`` (the n-th row taken, counted
across a resume); an ``id`` field stays in the row the episodes get. GRPO
compares the episodes of a group: the service runs every one of them and
reports each reward (``POST /sessions/<key>/reward``); an episode not ended
within ``agent.timeout_s`` fails (reward 0, ``n_agent_failed``).

Resume: a posted row whose group had not finished at the checkpoint is
regenerated from the row like any running group; its episodes have no waiting
request, so they are offered to ``POST /sessions`` with an empty body
(``{"key", "row", "group_id", "base_url"}``, one episode per call), as in the
mode where megarl hands out its own rows.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from megarl.data import Prompt, check_row
from megarl.errors import ConfigError, InputError


@dataclass
class _Post:
    """One posted row: its prompt, and the episodes of its group once the rollout loop took it."""

    prompt: Prompt
    admitted: asyncio.Future
    sessions: list = field(default_factory=list)
    full: asyncio.Future | None = None
    withdrawn: bool = False  # its request gave up before the rollout loop took it


class ServiceRows:
    """The run's prompt source when an agent service brings the rows (module docstring)."""

    def __init__(self, tokenizer: Any, data_cfg: Any, group_size: int, vocab_size: int | None = None,
                 wait_s: float = 60.0) -> None:
        self.tokenizer, self.data_cfg, self.group_size = tokenizer, data_cfg, group_size
        self.vocab_size, self.wait_s = vocab_size, wait_s
        self.n_posted = 0  # rows taken by the rollout loop; prompt ids are service:<n>, unique across a resume
        self._queue: asyncio.Queue[_Post] | None = None
        self._pending: dict[str, _Post] = {}  # prompt id -> the request waiting for its group's keys

    def prompt(self, row: Any) -> Prompt:
        """``row`` as a prompt (its id is given when the rollout loop takes it); InputError for a bad row."""
        if not isinstance(row, dict):
            raise InputError(f"'row' must be a JSON object like a line of a data file, got {type(row).__name__}")
        d = self.data_cfg
        prompt, ids, answer = check_row("the posted row", row, d.prompt_key, d.answer_key, self.vocab_size)
        if ids is None:
            ids = self.tokenizer.encode_rendered([self.tokenizer.render(prompt, "the posted row")])[0]
        if len(ids) > d.max_prompt_len:
            raise InputError(f"the posted row's prompt has {len(ids)} tokens, longer than data.max_prompt_len="
                             f"{d.max_prompt_len}")
        return Prompt("", ids, answer, {k: v for k, v in row.items() if k != "prompt_ids"})

    def _queued(self) -> asyncio.Queue[_Post]:
        if self._queue is None:
            self._queue = asyncio.Queue()
        return self._queue

    # -- the rollout loop's side ------------------------------------------------------
    async def next(self) -> Prompt:
        """The next posted row, once one is posted (the gate has admitted its group already)."""
        while True:
            post = await self._queued().get()
            if not post.withdrawn:
                break
        post.prompt.prompt_id = f"service:{self.n_posted}"
        self.n_posted += 1
        post.full = asyncio.get_running_loop().create_future()
        self._pending[post.prompt.prompt_id] = post
        post.admitted.set_result(None)
        return post.prompt

    def state_dict(self) -> dict[str, Any]:
        return {"source": "service", "n_posted": self.n_posted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") != "service":
            raise ConfigError(f"the checkpoint's prompts came from data.path={state.get('source')!r}; resume it "
                              f"with that data.path, not agent.rows_from_service=true")
        self.n_posted = int(state["n_posted"])

    # -- the endpoint's side -------------------------------------------------------------
    def take(self, session: Any) -> bool:
        """Hand ``session`` to the request that posted its row; False when none waits (a regenerated group)."""
        post = self._pending.get(session.client.traj.meta.get("prompt_id", ""))
        if post is None:
            return False
        post.sessions.append(session)
        if len(post.sessions) == self.group_size:
            del self._pending[post.prompt.prompt_id]
            post.full.set_result(None)
        return True

    async def post(self, row: Any) -> list | None:
        """Queue ``row``; its group's sessions, or None when the gate did not admit it within ``wait_s``.

        InputError for a bad row.
        """
        post = _Post(self.prompt(row), asyncio.get_running_loop().create_future())
        self._queued().put_nowait(post)
        try:
            await asyncio.wait_for(asyncio.shield(post.admitted), self.wait_s)
        except TimeoutError:
            pass
        finally:
            if not post.admitted.done():  # timed out, or the request went away: the row is not rolled out
                post.withdrawn = True
        if post.withdrawn:
            return None
        try:  # the group's episodes open their sessions as soon as its task runs
            await asyncio.wait_for(post.full, self.wait_s)
        except TimeoutError:
            self._pending.pop(post.prompt.prompt_id, None)
            raise RuntimeError(f"the group of the posted row (prompt {post.prompt.prompt_id}) failed before all "
                               f"{self.group_size} of its episodes started") from None
        return post.sessions
