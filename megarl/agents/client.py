"""An OpenAI-style chat client over megarl's engines, for agents written as ordinary async Python.

One :class:`AgentClient` serves one episode (one trajectory of a group)::

    resp = await client.chat.completions.create(messages=messages, tools=client.tool_schemas)
    msg = resp.choices[0].message          # openai's ChatCompletionMessage: content, tool_calls
    result = await client.call_tool(msg.tool_calls[0])

The call and return shapes are the ``openai`` package's; the work is megarl's
(docs/design.md, "Agents"):

- **rendering**: the conversation goes through the run's chat template, tools
  included, past tool calls' arguments as objects, as templates that apply
  ``tojson`` to them expect (megarl/tokenizer.py);
- **generation**: through the controller's interruptible generate path, so a
  publish in the middle of a turn resumes it with the new weights and every
  token carries its version;
- **token-exact records**: the trajectory holds exactly the ids the engine
  saw. A turn that extends the conversation so far appends only the new
  template text (tool results, the next user message, the generation prompt)
  as tokens with loss mask 0, tokenized as they follow the context; the
  model's own tokens are never re-tokenized.
  When the template renders the conversation so that it no longer starts with
  what the model saw (a template that rewrites past turns, as Qwen3's does
  with thinking content), the turn starts a new trajectory of the episode
  (``agent.turns=auto``); ``agent.turns=individual`` makes every completion a
  trajectory of its own. All of an episode's trajectories share its reward.
  Completions an agent starts concurrently run one after the other, each
  recorded whole (the second then usually starts a trajectory of its own).
- **tool calls** are parsed in the Hermes/Qwen3 ``<tool_call>`` format
  (tool_calls.py); a malformed call comes back as a tool call named
  ``invalid_tool_call`` whose result is the error, so the model is told. A
  turn that ran into its token limit (finish_reason ``length``) has no tool
  calls: its text comes back as content.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from megarl.agents.tool_calls import ParsedCall, ParsedOutput, parse_tool_calls
from megarl.types import GenerateResult, SamplingParams, Trajectory, append_turn

#: the tool name a malformed call gets, so that calling it hands the model its error
INVALID_TOOL = "invalid_tool_call"

GenerateInto = Callable[..., Awaitable[GenerateResult]]


class AgentLimitError(RuntimeError):
    """The episode went past ``agent.max_turns`` or its token budget (``agent.max_tokens``)."""


@dataclass(frozen=True)
class AgentLimits:
    """How an episode samples and how far it may go (``rollout.*`` sampling, ``agent.*`` limits)."""

    sampling: SamplingParams
    max_turns: int
    max_tokens: int
    #: auto: turns that extend the conversation stay one trajectory; individual: one per completion
    turns: str = "auto"

    def __post_init__(self) -> None:
        if self.turns not in ("auto", "individual"):
            raise ValueError(f"agent.turns={self.turns!r}; choose auto or individual")


@dataclass
class CompletionRecord:
    """What one completion sent to the engine and got back (ids exactly as the engine saw them)."""

    traj_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logp_behav: list[float]
    versions: list[int]
    finish_reason: str


@dataclass
class AgentStats:
    n_turns: int = 0
    n_tool_calls: int = 0
    n_tool_errors: int = 0
    n_new_trajectories: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # malformed call id -> its error


class _Completions:
    def __init__(self, client: "AgentClient") -> None:
        self._client = client

    async def create(self, *, messages: list[Any], tools: list[dict] | None = None, **kwargs: Any):
        return await self._client._complete(messages, tools, kwargs)


class _Chat:
    def __init__(self, client: "AgentClient") -> None:
        self.completions = _Completions(client)


class AgentClient:
    """The chat client of one episode (module docstring)."""

    def __init__(self, traj: Trajectory, generate: GenerateInto, tokenizer: Any, tools: Any,
                 limits: AgentLimits, prompt: Any = None) -> None:
        self.traj = traj
        #: the row's prompt as written, from the field ``data.prompt_key`` names (None when the row has none)
        self.prompt = prompt
        self._generate = generate
        self.tokenizer = tokenizer
        self.tools = tools
        self.limits = limits
        self.chat = _Chat(self)
        self.records: list[CompletionRecord] = []
        self.stats = AgentStats()
        #: the decoded final assistant message (what the reward service scores when the agent returns None)
        self.final_text = ""
        self._row: Trajectory | None = None  # the trajectory the next completion extends
        self._row_text = ""  # the text of self._row's tokens, as rendered and generated
        # completions an agent runs concurrently (asyncio.gather) go one after the other: two at once would
        # render against, and append into, the same row and interleave there
        self._one_at_a_time = asyncio.Lock()

    @property
    def max_turns(self) -> int:
        """Completions this episode may ask for (``agent.max_turns``)."""
        return self.limits.max_turns

    @property
    def tool_schemas(self) -> list[dict]:
        """The configured tools in OpenAI's format (pass them as ``tools=``)."""
        return list(self.tools.schemas) if self.tools is not None else []

    # -- completions ---------------------------------------------------------------------------
    async def _complete(self, messages: list[Any], tools: list[dict] | None, kwargs: dict[str, Any]):
        async with self._one_at_a_time:
            return await self._complete_alone(messages, tools, kwargs)

    async def idle(self) -> None:
        """Return once no completion is in flight (the episode's rows are complete)."""
        async with self._one_at_a_time:
            pass

    async def _complete_alone(self, messages: list[Any], tools: list[dict] | None, kwargs: dict[str, Any]):
        # a request refused here (another distribution, a conversation the template rejects) uses no turn
        sampling = self._sampling(kwargs)
        text = self.tokenizer.render_chat([_as_dict(m) for m in messages], tools=tools)
        self.stats.n_turns += 1
        if self.stats.n_turns > self.max_turns:
            raise AgentLimitError(f"the agent asked for completion {self.stats.n_turns}, more than "
                                  f"agent.max_turns={self.max_turns}")
        row = self._extend_or_start(text)
        budget = self.limits.max_tokens - len(row.tokens)
        if budget <= 0:
            raise AgentLimitError(f"the conversation holds {len(row.tokens)} tokens, agent.max_tokens="
                                  f"{self.limits.max_tokens} leaves none to generate")
        sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget))
        context = list(row.tokens)
        n_before = len(row.response_ids)
        try:
            result = await self._generate(context, sampling, into=row)
        except BaseException:
            # what the engine produced before the failure stays in the row: recorded too (the exactness check
            # accounts for every token), and the next completion starts a trajectory of its own
            self.records.append(CompletionRecord(row.traj_id, context, row.response_ids[n_before:],
                                                 row.logp_behav[n_before:], row.versions[n_before:], "error"))
            self._row = None
            raise
        append_turn(row, n_before, result)
        row.finish_reason = result.finish_reason
        self.records.append(CompletionRecord(row.traj_id, context, list(result.output_ids), list(result.logp_behav),
                                             list(result.versions), result.finish_reason))
        self._row_text += self.tokenizer.hf.decode(result.output_ids, skip_special_tokens=False)
        visible = self.tokenizer.decode_response(result.output_ids)
        self.final_text = visible
        return self._response(visible, result, len(context))

    def _sampling(self, kwargs: dict[str, Any]) -> SamplingParams:
        """The run's sampling settings; an agent may lower max_tokens and add stop ids, not change the
        distribution (the trainer computes log-probs at rollout.temperature, top_p and top_k)."""
        s = self.limits.sampling
        for key, mine in (("temperature", s.temperature), ("top_p", s.top_p)):
            if key in kwargs and kwargs[key] is not None and float(kwargs[key]) != mine:
                raise ValueError(f"{key}={kwargs[key]} differs from the run's rollout.{key}={mine}: the trainer "
                                 f"computes log-probs of the distribution the engine samples from, so an agent "
                                 f"cannot change it; set rollout.{key}")
        max_new = kwargs.get("max_tokens") or kwargs.get("max_completion_tokens") or s.max_new_tokens
        return replace(s, max_new_tokens=min(int(max_new), s.max_new_tokens))

    def _extend_or_start(self, text: str) -> Trajectory:
        """The trajectory this completion continues: the current one when ``text`` extends what it holds
        (the difference goes in as template tokens), else a new one (module docstring)."""
        row = self._row
        if row is not None and self.limits.turns == "auto" and text.startswith(self._row_text):
            delta = text[len(self._row_text):]
            if delta:  # tokenized in context: alone it could gain a word-start marker
                row.append_tool(self.tokenizer.encode_after(row.tokens, text, delta))
            self._row_text = text
            return row
        prompt_ids = self.tokenizer.hf.encode(text, add_special_tokens=False)
        if row is None and not self.traj.response_ids:  # the episode's first completion: its own trajectory
            self.traj.prompt_ids = prompt_ids
            new = self.traj
        else:
            # the row before stays unfinished until the episode ends: a publish meanwhile reports its tokens
            # as partial (the controller finishes all rows of an episode when the workflow returns)
            k = len(self.traj.parts) + 1
            new = Trajectory(traj_id=f"{self.traj.traj_id}.t{k}", group_id=self.traj.group_id, prompt_ids=prompt_ids,
                             meta=self.traj.meta, logp_old=[] if self.traj.logp_old is not None else None)
            self.traj.parts.append(new)
            self.stats.n_new_trajectories += 1
        self._row, self._row_text = new, text
        return new

    def _response(self, visible: str, result: GenerateResult, n_prompt: int):
        from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
        from openai.types.chat.chat_completion import Choice
        from openai.types.chat.chat_completion_message_tool_call import Function
        from openai.types.completion_usage import CompletionUsage

        # a turn cut off at its token limit is unfinished: a <tool_call> in it is not a call the model made,
        # even when its JSON happens to be complete (it ran out before </tool_call>)
        parsed = parse_tool_calls(visible) if result.finish_reason != "length" else ParsedOutput(visible)
        calls = []
        for c in parsed.calls:
            if c.error is not None:
                self.stats.errors[c.id] = c.error
                self.stats.n_tool_errors += 1
            calls.append(ChatCompletionMessageToolCall(id=c.id, type="function", function=Function(
                name=c.name if c.error is None else INVALID_TOOL,
                arguments=c.arguments if c.error is None else c.raw)))
        finish = "tool_calls" if calls else ("length" if result.finish_reason == "length" else "stop")
        message = ChatCompletionMessage(role="assistant", content=parsed.content if calls else visible,
                                        tool_calls=calls or None)
        n_out = len(result.output_ids)
        return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex[:16]}", object="chat.completion",
                              created=int(time.time()),
                              model=self.tokenizer.source, choices=[Choice(index=0, message=message,
                                                                           finish_reason=finish)],
                              usage=CompletionUsage(prompt_tokens=n_prompt, completion_tokens=n_out,
                                                    total_tokens=n_prompt + n_out))

    # -- tools -----------------------------------------------------------------------------------
    async def call_tool(self, call: Any) -> str:
        """Run one tool call of a returned message (``message.tool_calls[i]`` or its dict); the text to send
        back as ``{"role": "tool", "tool_call_id": call.id, "content": ...}``. Never raises for a bad call."""
        call = _as_dict(call)
        fn = call.get("function") or {}
        self.stats.n_tool_calls += 1
        if fn.get("name") == INVALID_TOOL:
            return f"Error: {self.stats.errors.get(call.get('id'), 'malformed tool call')}"
        if self.tools is None:
            self.stats.n_tool_errors += 1
            return f"Error: no tools are configured (agent.tools), cannot call {fn.get('name')!r}"
        result = await self.tools.call(fn.get("name"), fn.get("arguments"))
        self.stats.n_tool_errors += result.error is not None
        return result.content


def _as_dict(obj: Any) -> dict:
    """A message or tool call as a plain dict (openai's pydantic models or dicts)."""
    if isinstance(obj, dict):
        return obj
    return obj.model_dump(exclude_none=True)


__all__ = ["AgentClient", "AgentLimitError", "AgentLimits", "CompletionRecord", "INVALID_TOOL", "ParsedCall"]
