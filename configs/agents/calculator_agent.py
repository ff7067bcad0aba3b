"""An agent in another process (rollout.workflow=agent_http), written against the plain openai package.

megarl runs it once per episode: the data row arrives as JSON on stdin,
OPENAI_BASE_URL and OPENAI_API_KEY name the run's endpoint and this episode.
The model may call the ``add`` tool, which this script runs itself; the last
line printed is the final answer that reward.fn scores. The conversation
opens with one worked example that uses the tool.

    megarl train --config configs/tiny_agent_cpu.yaml rollout.workflow=agent_http \
        agent.command="python configs/agents/calculator_agent.py"
"""
import json
import sys

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
EXAMPLE = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "5"},
    {"role": "assistant", "content": "\\boxed{5}"},
]


def run_tool(call) -> str:
    """The tool's result, or the error the model is told about."""
    if call.function.name != "add":
        return f"Error: unknown tool {call.function.name!r}"
    try:
        args = json.loads(call.function.arguments)
        return str(int(args["a"]) + int(args["b"]))
    except Exception as e:  # the model wrote bad arguments: it is told
        return f"Error: {type(e).__name__}: {e}"


def main() -> None:
    row = json.load(sys.stdin)
    client = OpenAI()  # from OPENAI_BASE_URL / OPENAI_API_KEY
    model = client.models.list().data[0].id
    prompt = row["prompt"]
    messages = [{"role": "system", "content": "Solve the problem; you may use the add tool. Answer as \\boxed{N}."},
                *EXAMPLE, *(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])]
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    print(" ".join((message.content or "").split()) or "(no answer)")


if __name__ == "__main__":
    main()
