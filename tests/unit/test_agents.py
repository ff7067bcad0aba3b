"""Agents: tool-call parsing, tools in worker processes, and the chat client's token-exact records.

The engine is a scripted stand-in for the controller's generate function only
(it replays model outputs and appends them to the trajectory it is given, as
the controller does); the tokenizer, chat template, tool service and workers
are the real ones. tests/e2e/test_agent_runs.py runs agents on the real vLLM engine.
"""
import asyncio
import copy
import sys
from pathlib import Path

import pytest

from megarl.agents.client import INVALID_TOOL, AgentClient, AgentLimitError, AgentLimits
from megarl.agents.tool_calls import parse_tool_calls
from megarl.agents.tools import ToolService, tool_schema
from megarl.errors import ConfigError
from megarl.models.tiny_tokenizer import CHATML
from megarl.types import GenerateResult, SamplingParams, Trajectory
from megarl.workflows.agent import AgentWorkflow, check_token_exact, load_agent

sys.path.insert(0, str(Path(__file__).resolve().parent))  # agent_fixtures, for the worker processes too

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=64)


def run(coro):
    return asyncio.run(coro)


# -- parsing ------------------------------------------------------------------------------------
def test_parse_tool_calls():
    out = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2)"}}\n'
                           '</tool_call>')
    assert out.content == "Let me compute." and not out.malformed
    (call,) = out.calls
    assert (call.name, call.arguments) == ("python", '{"code": "print(2)"}')
    assert parse_tool_calls("no call here").calls == []
    bad = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": </tool_call><tool_call>[1]')
    assert [c.error is not None for c in bad.calls] == [True, True]
    assert "not valid JSON" in bad.calls[0].error and "must be an object" in bad.calls[1].error


# -- tools --------------------------------------------------------------------------------------
def test_schema_from_the_signature():
    import agent_fixtures

    schema = tool_schema("add", agent_fixtures.add)
    assert schema["function"]["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                 "b": {"type": "integer"}},
                                                "required": ["a"]}
    assert schema["function"]["description"] == "Add two integers."
    with pytest.raises(ConfigError, match="needs an int, float, str or bool annotation"):
        tool_schema("untyped", agent_fixtures.untyped)


def test_tools_run_in_workers_and_failures_become_messages():
    async def main(tools):
        return [await tools.call("add", '{"a": 2, "b": 3}'),
                await tools.call("python", '{"code": "print(6 * 7)"}'),
                await tools.call("nope", "{}"),
                await tools.call("add", '{"c": 1}'),
                await tools.call("add", "{not json"),
                await tools.call("hang", "{}"),
                await tools.call("hog", "{}"),
                await tools.call("add", '{"a": 1}')]  # the pool serves on after the failures

    tools = ToolService(["agent_fixtures:add", "python", "agent_fixtures:hang", "agent_fixtures:hog"],
                        timeout_s=2.0, memory_mb=256)
    try:
        add, py, unknown, bad_args, bad_json, hang, hog, after = run(main(tools))
    finally:
        tools.close()
    assert (add.content, add.error) == ("5", None) and py.content == "42"
    assert unknown.error == "unknown tool 'nope'; available: add, python, hang, hog"
    assert "bad arguments for add" in bad_args.error and "not valid JSON" in bad_json.error
    assert "failed (timeout)" in hang.error and "failed (memory)" in hog.error
    assert all(r.content.startswith("Error: ") for r in (unknown, bad_args, bad_json, hang, hog))
    assert after.content == "1"


def test_bad_tool_configuration_fails_before_the_run():
    with pytest.raises(ConfigError, match="no_such_module"):
        ToolService(["no_such_module:tool"])
    with pytest.raises(ConfigError, match="names two tools 'add'"):
        ToolService(["agent_fixtures:add", "agent_fixtures.add"])


# -- the client ---------------------------------------------------------------------------------
class ScriptedModel:
    """Replays model outputs and appends them to the trajectory it is given: text (the EOS id is added), a list
    of ids as they are, or ``Length(text)``: a turn cut off at its token limit (no EOS)."""

    def __init__(self, tokenizer, outputs, version=3):
        self.tok = tokenizer
        self.outputs = list(outputs)
        self.version = version
        self.contexts = []

    async def __call__(self, context, sampling, into):
        self.contexts.append(list(context))
        out = self.outputs.pop(0)
        finish = "length" if isinstance(out, Length) else "stop"
        if isinstance(out, list):
            ids = list(out)
        else:
            ids = self.tok.hf.encode(str(out), add_special_tokens=False)
            ids += [self.tok.hf.eos_token_id] if finish == "stop" else []
        into.append_policy(ids, [-0.5] * len(ids), [self.version] * len(ids))
        self.version += 1
        return GenerateResult("r", ids, [-0.5] * len(ids), [self.version - 1] * len(ids), finish)


class Length(str):
    """A scripted turn that ran into its token limit."""


def client_for(tokenizer, outputs, tools=None, **kw):
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {}}, logp_old=[])
    model = ScriptedModel(tokenizer, outputs)
    kw = {"max_turns": 8, "max_tokens": 1024, **kw}
    return AgentClient(traj, model, tokenizer, tools, AgentLimits(SAMPLING, **kw)), traj, model


async def tool_turns(client, n=3):
    """``n`` completions, each answered by a tool result; the last reply and the conversation."""
    messages = [{"role": "user", "content": "go"}]
    for turn in range(n):
        reply = await client.chat.completions.create(messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "content": f"result {turn}"})
    return reply, messages


def test_three_turns_with_tool_results_are_one_token_exact_trajectory(text_tokenizer):
    client, traj, model = client_for(text_tokenizer, ["a1", "b2", "c3"])
    last, _ = run(tool_turns(client))
    assert last.choices[0].message.content == "c3" and last.choices[0].finish_reason == "stop"
    assert traj.parts == [] and len(client.records) == 3
    check_token_exact(traj, client.records)
    # what the engine saw each turn is the conversation so far as ChatML writes it (spelled out here, encoded
    # whole), and the trajectory's prefix; the model's own tokens are policy tokens of the version that sampled
    # them, the template and tool results are not
    def tool_turn(said: str, n: int) -> str:
        return (f"{said}<|im_end|>\n<|im_start|>user\n<tool_response>\nresult {n}\n</tool_response><|im_end|>\n"
                f"<|im_start|>assistant\n")

    first = "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    seen = [first, first + tool_turn("a1", 0), first + tool_turn("a1", 0) + tool_turn("b2", 1)]
    expected = [text_tokenizer.hf.encode(text, add_special_tokens=False) for text in seen]
    assert model.contexts == [rec.prompt_ids for rec in client.records] == expected
    assert all(traj.tokens[:len(ids)] == ids for ids in expected)
    assert traj.policy_versions() == {3, 4, 5} and traj.n_policy_tokens == 3 * 3
    decoded = text_tokenizer.hf.decode(traj.tokens)
    assert decoded == text_tokenizer.render_chat([
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "result 0"}, {"role": "assistant", "content": "b2"},
        {"role": "tool", "content": "result 1"}]) + "c3<|im_end|>"


#: ChatML as Qwen3's template writes it: an assistant turn before the last user message loses its reasoning
#: (``<think>...</think>``), so the next turn's rendering no longer extends what the model saw and wrote
CHATML_DROPS_PAST_THINKING = CHATML.replace(
    "{%- for message in messages %}",
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 < ns.last_user and message.content "
    "and '</think>' in message.content %}"
    "{%- set message = {'role': 'assistant', 'content': message.content.split('</think>')[-1].lstrip('\\n')} %}"
    "{%- endif %}", 1)
#: ChatML writing every tool call's arguments with ``tojson`` (Qwen2.5's, Llama 3.1's templates): a call the
#: model wrote compactly comes back spaced as json.dumps spaces it
CHATML_TOJSON = CHATML.replace("fn.arguments if fn.arguments is string else (fn.arguments | tojson)",
                               "fn.arguments | tojson")
COMPACT_CALL = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'


@pytest.mark.parametrize("template, said, rewritten", [
    (CHATML_DROPS_PAST_THINKING, "<think>hm</think>x1", "<|im_start|>assistant\nx1<|im_end|>\n"),
    (CHATML_TOJSON, COMPACT_CALL, '\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'),
], ids=["past-thinking-dropped", "tojson-arguments"])
def test_a_template_that_rewrites_the_past_starts_a_new_trajectory(text_tokenizer_dir, tmp_path, template, said,
                                                                   rewritten):
    assert template != CHATML
    tok = _tokenizer_with_template(text_tokenizer_dir, tmp_path, template)
    client, traj, _ = client_for(tok, [said, "y2"])

    async def episode():
        messages = [{"role": "user", "content": "go"}]
        reply = await client.chat.completions.create(messages=messages)
        # the agent passes the model's message back untouched: only the template rewrites it
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(messages=messages)
        return reply

    reply = run(episode())
    # both rows stay unfinished until the episode returns (a publish meanwhile reports them as partial)
    assert [r.traj_id for r in traj.rows()] == ["g0-0", "g0-0.t1"] and not any(r.finished for r in traj.rows())
    assert client.stats.n_new_trajectories == 1
    first, part = traj, traj.parts[0]
    assert tok.hf.decode(first.response_ids) == said + "<|im_end|>"  # the first row keeps what the model wrote
    past = tok.hf.decode(part.prompt_ids)
    assert rewritten in past and said not in past
    assert past.endswith("<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    assert len(part.logp_old) == len(part.response_ids) == 3  # exact strategies fill it in later
    assert reply.choices[0].finish_reason == ("tool_calls" if "tool_call" in said else "stop")
    check_token_exact(traj, client.records)


def test_individual_turns(text_tokenizer):
    client, traj, _ = client_for(text_tokenizer, ["x1", "y2"], turns="individual")

    async def episode():
        messages = [{"role": "user", "content": "go"}]
        r = await client.chat.completions.create(messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(messages=messages)

    run(episode())
    assert len(traj.rows()) == 2 and client.stats.n_new_trajectories == 1


def test_tool_calls_are_parsed_and_malformed_ones_answered(text_tokenizer):
    tools = ToolService(["agent_fixtures:add"], timeout_s=5.0)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    client, traj, _ = client_for(text_tokenizer, [good, '<tool_call>{"name": add}</tool_call>'], tools=tools)

    async def episode():
        messages = [{"role": "user", "content": "go"}]
        out = []
        for _ in range(2):
            r = await client.chat.completions.create(messages=messages, tools=client.tool_schemas)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                out.append((r.choices[0].finish_reason, call.function.name, await client.call_tool(call)))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": out[-1][2]})
        return out

    try:
        (r1, r2) = run(episode())
    finally:
        tools.close()
    assert r1 == ("tool_calls", "add", "3")
    assert r2[1] == INVALID_TOOL and r2[2].startswith("Error: tool call is not valid JSON")
    assert (client.stats.n_tool_calls, client.stats.n_tool_errors) == (2, 1)
    assert traj.parts == []  # the template renders the call as the model wrote it: one trajectory
    check_token_exact(traj, client.records)


def test_a_turn_cut_off_inside_a_tool_call_is_a_length_finish(text_tokenizer):
    tools = ToolService(["agent_fixtures:add"], timeout_s=5.0)
    # the call's JSON happens to be complete when the token limit strikes, before </tool_call>
    cut = Length('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    client, traj, _ = client_for(text_tokenizer, [cut], tools=tools)
    try:
        reply = run(client.chat.completions.create(messages=[{"role": "user", "content": "go"}],
                                                   tools=client.tool_schemas))
    finally:
        tools.close()
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content == str(cut)
    assert client.stats.n_tool_errors == 0 and traj.finish_reason == "length"


def _tokenizer_with_template(tokenizer_dir, out_dir, template):
    from conftest import run_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf.chat_template = template
    hf.save_pretrained(str(out_dir))
    return run_tokenizer(out_dir)


def test_past_tool_call_arguments_render_as_objects_in_a_real_template(text_tokenizer_dir, tmp_path):
    # Llama 4's chat template, as transformers ships it, writes `arguments | tojson` whatever their type
    from transformers.models.llama4.processing_llama4 import chat_template

    tok = _tokenizer_with_template(text_tokenizer_dir, tmp_path, chat_template)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    text = tok.render_chat(messages)
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot|>' in text
    assert call["function"]["arguments"] == '{"a": 1, "b": 2}'  # the agent's own messages are left as they are


def test_tool_turns_stay_one_trajectory_with_a_template_that_applies_tojson(text_tokenizer_dir, tmp_path):
    tok = _tokenizer_with_template(text_tokenizer_dir, tmp_path, CHATML_TOJSON)
    tools = ToolService(["agent_fixtures:add"], timeout_s=5.0)
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    client, traj, _ = client_for(tok, [good, good, "done"], tools=tools)

    async def episode():
        messages = [{"role": "user", "content": "go"}]
        for _ in range(3):
            reply = await client.chat.completions.create(messages=messages, tools=client.tool_schemas)
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await client.call_tool(call)})

    try:
        run(episode())
    finally:
        tools.close()
    assert traj.parts == [] and client.stats.n_new_trajectories == 0
    check_token_exact(traj, client.records)


def _word_start_tokenizer(out_dir):
    """A character-level tokenizer whose pre-tokenizer adds SentencePiece's word-start marker \u2581 to the start
    of a text (Metaspace, as Llama 2's and Mistral's do): "\\nab" alone is [\u2581, \\n, a, b], after <|im_end|>
    [\\n, a, b]."""
    from conftest import run_tokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*special, "<unk>", *map(chr, range(32, 127)), "\n", "\u2581"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    marker = {"replacement": "\u2581", "prepend_scheme": "first", "split": False}
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(**marker),
                                                  pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")])
    core.decoder = decoders.Metaspace(**marker)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    hf = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    hf.save_pretrained(str(out_dir))
    tok = run_tokenizer(out_dir)
    assert tok.hf.convert_ids_to_tokens(tok.hf.encode("\nab", add_special_tokens=False)) == ["\u2581", "\n", "a", "b"]
    return tok


def test_text_between_turns_is_tokenized_in_context(tmp_path):
    tok = _word_start_tokenizer(tmp_path)
    eos = tok.hf.eos_token_id
    said = ["a1", "b 2", "c3"]  # what the model says, as ids in context (no marker after "assistant\n")
    client, traj, _ = client_for(tok, [tok.hf.convert_tokens_to_ids(list(s.replace(" ", "\u2581"))) + [eos]
                                       for s in said])
    _, messages = run(tool_turns(client))
    assert [m["content"] for m in messages if m["role"] == "assistant"] == said
    assert traj.parts == []
    check_token_exact(traj, client.records)
    # the row is exactly how the whole conversation tokenizes in one piece: no marker after each <|im_end|>
    whole = tok.render_chat(messages[:-2]) + "c3<|im_end|>"
    assert traj.tokens == tok.hf.encode(whole, add_special_tokens=False)


def test_text_after_tokens_that_are_not_how_their_text_tokenizes_is_tokenized_in_context(tmp_path):
    # the model writes "a" with a word-start marker before it: its text reads "a", which tokenizes without one,
    # so the whole rendering does not start with the recorded ids; the tool turn is tokenized after <|im_end|>
    tok = _word_start_tokenizer(tmp_path)
    marker, eos = tok.hf.convert_tokens_to_ids("\u2581"), tok.hf.eos_token_id
    client, traj, _ = client_for(tok, [[marker, tok.hf.convert_tokens_to_ids("a"), eos], "b"])
    _, messages = run(tool_turns(client, 2))
    assert messages[1]["content"] == "a" and traj.parts == []
    check_token_exact(traj, client.records)
    n_first = len(client.records[0].prompt_ids) + 3
    template = traj.tokens[n_first:len(client.records[1].prompt_ids)]
    first_text = tok.render_chat(messages[:1]) + "a<|im_end|>"
    delta = tok.render_chat(messages[:3])[len(first_text):]  # the tool result and the generation prompt
    assert template == tok.hf.encode("<|im_end|>" + delta, add_special_tokens=False)[1:] and template[0] != marker


class ChunkedModel(ScriptedModel):
    """Appends each output in two chunks with a pause between them, as the controller's generate does."""

    async def __call__(self, context, sampling, into):
        self.contexts.append(list(context))
        ids = self.tok.hf.encode(self.outputs.pop(0), add_special_tokens=False) + [self.tok.hf.eos_token_id]
        version, self.version = self.version, self.version + 1
        for chunk in (ids[:2], ids[2:]):
            into.append_policy(chunk, [-0.5] * len(chunk), [version] * len(chunk))
            await asyncio.sleep(0.01)
        return GenerateResult("r", ids, [-0.5] * len(ids), [version] * len(ids), "stop")


def test_concurrent_completions_of_one_episode_are_recorded_one_at_a_time(text_tokenizer):
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {}}, logp_old=[])
    model = ChunkedModel(text_tokenizer, ["abcd", "wxyz"])
    client = AgentClient(traj, model, text_tokenizer, None, AgentLimits(SAMPLING, max_turns=4, max_tokens=512))
    messages = [{"role": "user", "content": "go"}]

    async def both():
        return await asyncio.gather(client.chat.completions.create(messages=messages),
                                    client.chat.completions.create(messages=messages))

    first, second = run(both())
    assert (first.choices[0].message.content, second.choices[0].message.content) == ("abcd", "wxyz")
    # the second waited for the first; its conversation does not extend the first's answer: a row of its own
    prompt = text_tokenizer.hf.encode(text_tokenizer.render_chat(messages), add_special_tokens=False)
    eos = text_tokenizer.hf.eos_token_id
    assert [r.tokens for r in traj.rows()] == [
        prompt + text_tokenizer.hf.encode("abcd", add_special_tokens=False) + [eos],
        prompt + text_tokenizer.hf.encode("wxyz", add_special_tokens=False) + [eos]]
    check_token_exact(traj, client.records)


def test_the_exactness_check_covers_every_token(text_tokenizer):
    client, traj, _ = client_for(text_tokenizer, ["a1", "b2"])
    run(tool_turns(client, 2))
    check_token_exact(traj, client.records)
    n_first = len(client.records[0].prompt_ids) + len(client.records[0].output_ids)
    template = slice(n_first - len(traj.prompt_ids), len(client.records[1].prompt_ids) - len(traj.prompt_ids))
    broken = [("a token after the last completion", lambda t: t.append_tool([5])),
              ("a template token marked as the policy's", lambda t: t.loss_mask.__setitem__(template.start, 1)),
              ("a template token with a version", lambda t: t.versions.__setitem__(template.stop - 1, 3)),
              ("a prompt longer than the first completion saw", lambda t: t.prompt_ids.append(5))]
    for what, damage in broken:
        bad = copy.deepcopy(traj)
        damage(bad)
        with pytest.raises(RuntimeError, match="not recorded token-exactly"):
            check_token_exact(bad, client.records)
            pytest.fail(f"{what} went unnoticed")


class FailsFirst(ScriptedModel):
    """Its first completion appends two tokens, then the engine is lost; the next ones are scripted."""

    async def __call__(self, context, sampling, into):
        if self.contexts:
            return await super().__call__(context, sampling, into)
        self.contexts.append(list(context))
        into.append_policy([70, 71], [-0.5, -0.5], [3, 3])
        raise ConnectionError("engine gone")


def test_a_completion_that_fails_midway_is_recorded_as_far_as_it_went(text_tokenizer):
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {}}, logp_old=[])
    client = AgentClient(traj, FailsFirst(text_tokenizer, ["ok"]), text_tokenizer, None,
                         AgentLimits(SAMPLING, max_turns=4, max_tokens=512))

    async def episode():  # an agent that carries on after the failure
        with pytest.raises(ConnectionError):
            await client.chat.completions.create(messages=[{"role": "user", "content": "go"}])
        return await client.chat.completions.create(messages=[{"role": "user", "content": "again"}])

    assert run(episode()).choices[0].message.content == "ok"
    assert traj.response_ids == [70, 71] and [r.finish_reason for r in client.records] == ["error", "stop"]
    assert len(traj.parts) == 1  # the next completion does not continue the broken row
    check_token_exact(traj, client.records)


def test_limits_and_sampling_are_the_runs(text_tokenizer):
    client, _, _ = client_for(text_tokenizer, ["a", "b"], max_turns=1)
    msgs = [{"role": "user", "content": "go"}]
    with pytest.raises(AgentLimitError, match="more than agent.max_turns=1"):
        run(_twice(client, msgs))
    client, _, _ = client_for(text_tokenizer, ["a"], max_tokens=20)
    with pytest.raises(AgentLimitError, match="agent.max_tokens=20 leaves none"):
        run(client.chat.completions.create(messages=[{"role": "user", "content": "a long question, really"}]))
    client, _, _ = client_for(text_tokenizer, ["a"])
    with pytest.raises(ValueError, match=r"temperature=0.5 differs from the run's rollout.temperature=1.0"):
        run(client.chat.completions.create(messages=msgs, temperature=0.5))


async def _twice(client, messages):
    await client.chat.completions.create(messages=messages)
    await client.chat.completions.create(messages=messages)


# -- the workflow ---------------------------------------------------------------------------------
def test_agent_functions_are_checked_when_loaded():
    with pytest.raises(ConfigError, match="is not an async function"):
        load_agent("agent_fixtures:not_async")
    with pytest.raises(ConfigError, match="must take \\(client, row\\)"):
        load_agent("agent_fixtures:no_row")
    assert load_agent("math_python").__name__ == "agent"


def test_tools_need_a_template_that_shows_them(demo_tokenizer_dir, tmp_path):
    from conftest import run_tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tools in it
    hf.save_pretrained(str(tmp_path))
    tools = ToolService(["agent_fixtures:add"])
    try:
        with pytest.raises(ConfigError, match="does not show tools to the model"):
            AgentWorkflow(load_agent("agent_fixtures:scripted"), run_tokenizer(tmp_path), tools,
                          AgentLimits(SAMPLING, max_turns=4, max_tokens=128))
    finally:
        tools.close()


def test_a_failing_agent_costs_its_episode_not_the_run(text_tokenizer):
    wf = AgentWorkflow(load_agent("agent_fixtures:raises_after_one_turn"), text_tokenizer, None,
                       AgentLimits(SAMPLING, max_turns=4, max_tokens=512))
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {"prompt": "hi"}})
    run(wf.run(traj, ScriptedModel(text_tokenizer, ["ok"])))
    assert traj.reward == 0.0 and traj.meta["agent_error"] == "RuntimeError: the agent broke"
    assert wf.stats()["n_agent_failed"] == 1 and wf.stats()["n_agent_turns"] == 1
    assert traj.n_policy_tokens == 3  # "ok" + EOS: what it generated stays, with reward 0


def test_agent_configuration_is_checked_before_the_run(text_tokenizer, text_tokenizer_dir):
    from conftest import run_tokenizer

    from megarl.config.schema import AgentConfig
    from megarl.workflows.agent_checks import check_agent_config

    check_agent_config(AgentConfig(fn="math_python", tools=["python", "agent_fixtures:add"]), text_tokenizer)
    with pytest.raises(ConfigError, match="is not an async function"):
        check_agent_config(AgentConfig(fn="agent_fixtures:not_async"), text_tokenizer)
    with pytest.raises(ConfigError, match="needs an int, float, str or bool annotation"):
        check_agent_config(AgentConfig(tools=["agent_fixtures:untyped"]), text_tokenizer)
    with pytest.raises(ConfigError, match="more than the model's max_position_embeddings"):
        check_agent_config(AgentConfig(max_tokens=text_tokenizer.model_max_len + 1), text_tokenizer)
    with pytest.raises(ConfigError, match="needs a chat template"):
        check_agent_config(AgentConfig(), run_tokenizer(text_tokenizer_dir, apply_chat_template=False))


def test_math_python_reads_the_prompt_under_data_prompt_key(text_tokenizer):
    from megarl.config.schema import MegaRLConfig
    from megarl.workflows import build_workflow

    cfg = MegaRLConfig()
    cfg.data.prompt_key = "problem.text"
    wf = build_workflow("agent", cfg, text_tokenizer)
    traj = Trajectory("g0-0", "g0", [1], meta={"row": {"problem": {"text": "What is 6*7?"}, "answer": "42"}})
    model = ScriptedModel(text_tokenizer, ["\\boxed{42}"])
    run(wf.run(traj, model))
    wf.close()
    assert "agent_error" not in traj.meta and wf.stats()["n_agent_failed"] == 0
    assert text_tokenizer.hf.decode(model.contexts[0]).endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n"
                                                                "<|im_start|>assistant\n")
    assert traj.meta["final_response"] == "\\boxed{42}"
