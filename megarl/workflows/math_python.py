"""The built-in agent "math with python": the example to copy for an agent of your own.

The model reads a math problem, may run Python code (the sandboxed ``python``
tool: ``agent.tools: [python]``) as often as ``agent.max_turns`` allows, and
ends with its answer in ``\\boxed{}``. It returns None, so the reward service
scores the final answer (``reward.fn: math``: math-verify against the row's
ground truth). Configured by ``configs/tiny_agent_cpu.yaml``.
"""
from __future__ import annotations

SYSTEM = ("You solve math problems. You may run Python code with the python tool to compute; "
          "give the final answer as \\boxed{N}.")


async def agent(client, row) -> float | None:
    prompt = client.prompt  # the row's field that data.prompt_key names
    if prompt is None:
        raise ValueError(f"the row has no prompt under data.prompt_key (its fields: {sorted(row)[:12]})")
    messages = [{"role": "system", "content": SYSTEM}]
    messages += prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    for _ in range(client.max_turns):
        reply = await client.chat.completions.create(messages=messages, tools=client.tool_schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:  # an answer: the reward service scores it
            return None
        for call in message.tool_calls:
            result = await client.call_tool(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
