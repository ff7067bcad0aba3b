"""The built-in agent "calculator": arithmetic that needs a tool, in a form a tiny random model can learn.

The environment holds the operands; the model's tool action is one character.
Turn 1 shows the problem (``4821*907``, a row of megarl/tasks/long_arithmetic.py).
A reply that starts with an operator (``+`` or ``*``, leading whitespace
ignored; what follows it is ignored too) calls the calculator on the problem's
two operands with that operator: its result comes back as a ``tool`` message (a ``<tool_response>`` block in a user
turn with the ChatML template) and the model replies again. Any other reply is
the final answer, so the model decides whether to use the tool, and with which
operator. The rule is the same at every turn: a call on the last turn
``agent.max_turns`` allows has no turn left for its answer, so the episode ends
without one and scores 0, as an agent that runs out of turns does. (A reply
such as ``+24`` after the result is another call, not an answer with a wrong
first character: the answer turn must not repeat the call.) An episode that
answers returns None: the reward service scores its final answer
(``reward.fn: digits``).

A calculator call counts in the run's ``n_tool_calls`` (so per step,
``n_tool_calls / n_reward_calls`` is the share of episodes that used the tool).
The agent ``calculator_off`` is the baseline without the tool: an operator
reply gets an empty tool response, the rest is the same.
``megarl.workflows.calculator:agent_always_calls`` is a diagnostic: every
episode calls the calculator with the problem's own operator (turn 1 is part
of the prompt, not sampled), so the model only learns to read the result: it
separates learning to use a result from learning to ask for it.
The agent ``calculator_guided`` mixes the two: half of the episodes (chosen by a
hash of the trajectory id, so about half of every group) get the forced call of
``agent_always_calls``, the rest are free episodes of ``calculator``. Forced
episodes teach reading a result; free episodes that call the tool then pay as
soon as it is read, which is what turns the call itself into a rewarded
choice. Only free episodes' calls count in ``n_tool_calls``.
The agent ``calculator_bonus`` (``agent_tool_bonus``) is the free agent with a
shaping reward: an episode that answers scores the digits reward of its final
answer plus :data:`TOOL_BONUS` when it called the calculator with the
problem's own operator (a reward for a correct tool call, common in agentic
RL); an episode without an answer scores 0. Such a call is then worth at
least a direct answer of the right length even before the model can read the
result, so calls survive until copying the result pays; a call with the
other operator earns nothing extra (its result is not the answer, and a bonus
for it taught one seed to call with one operator always and answer with
filler of the answer's length).
Evaluate it with ``eval.agent_fn=calculator``: held-out rewards and pass@1
then score the final answer alone.
Configured by ``configs/tiny_calc_agent_cpu.yaml``.
"""
from __future__ import annotations

import operator
import re
import zlib

from megarl.rewards.digits import digit_reward

OPERATORS = {"+": operator.add, "*": operator.mul}
TOOL_BONUS = 0.3
"""What ``agent_tool_bonus`` adds to an episode that called the calculator with the problem's operator: above
the ~0.25 a direct answer of the right length earns with no digit right (reward.fn digits), so such a call is
never worse early on."""
_PROBLEM = re.compile(r"\s*(\d+)\s*([+*])\s*(\d+)\s*")


def calculate(a: int, op: str, b: int) -> int:
    """``a op b`` for integers and op ``+`` or ``*`` (no evaluation of text); ValueError otherwise."""
    if op not in OPERATORS:
        raise ValueError(f"the calculator knows {sorted(OPERATORS)}, not {op!r}")
    if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
        raise ValueError(f"the calculator takes integers, got {a!r} and {b!r}")
    return OPERATORS[op](a, b)


def parse_problem(prompt: str) -> tuple[int, str, int]:
    """``"4821*907"`` -> ``(4821, "*", 907)``; ValueError for anything else."""
    m = _PROBLEM.fullmatch(prompt) if isinstance(prompt, str) else None
    if m is None:
        raise ValueError(f"the calculator agent needs a prompt 'A+B' or 'A*B' of digits, got {prompt!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


async def run_episode(client, row, tool_on: bool = True, bonus: float | None = None) -> float | None:
    """One episode (module docstring). It ends at the first reply that is not a call (the final answer): then
    None (the reward service scores it) or, with a ``bonus``, the digits reward of the final answer plus
    ``bonus`` if the episode called the calculator with the problem's operator. A call on the last allowed
    turn leaves no answer: 0.0."""
    a, problem_op, b = parse_problem(client.prompt)
    messages = [{"role": "user", "content": client.prompt}]
    right_call = False
    for turn in range(1, client.max_turns + 1):
        reply = await client.chat.completions.create(messages=messages)
        text = reply.choices[0].message.content or ""
        op = text.lstrip()[:1]
        if op not in OPERATORS:  # the reply is the final answer
            if bonus is None:
                return None
            return _final_reward(reply, row) + (bonus if right_call else 0.0)
        if turn == client.max_turns:
            break  # no turn left for an answer: the calculator is not run
        client.stats.n_tool_calls += 1
        right_call = right_call or op == problem_op
        result = str(calculate(a, op, b)) if tool_on else ""
        messages += [{"role": "assistant", "content": text},
                     {"role": "tool", "tool_call_id": "calc", "content": result}]
    return 0.0


def _final_reward(reply, row) -> float:
    """The digits reward of ``reply`` as the final answer (as reward.fn digits scores it)."""
    choice = reply.choices[0]
    return digit_reward(choice.message.content or "", row["answer"],
                        finish_reason="length" if choice.finish_reason == "length" else "stop")


async def agent(client, row) -> None:
    """The calculator agent (module docstring)."""
    return await run_episode(client, row, tool_on=True)


async def agent_without_tool(client, row) -> None:
    """The baseline: the same protocol, but an operator reply gets an empty tool response."""
    return await run_episode(client, row, tool_on=False)


async def agent_always_calls(client, row) -> None:
    """The diagnostic (module docstring): the calculator's result on the problem is in the prompt."""
    a, op, b = parse_problem(client.prompt)
    messages = [{"role": "user", "content": client.prompt}, {"role": "assistant", "content": op},
                {"role": "tool", "tool_call_id": "calc", "content": str(calculate(a, op, b))}]
    await client.chat.completions.create(messages=messages)
    return None


async def agent_tool_bonus(client, row) -> float:
    """The free agent with the shaping reward (module docstring): digits reward + TOOL_BONUS for a right call."""
    return await run_episode(client, row, tool_on=True, bonus=TOOL_BONUS)


def is_guided(traj_id: str) -> bool:
    """Whether ``calculator_guided`` forces the call in the episode of ``traj_id`` (half of all ids)."""
    return zlib.crc32(traj_id.encode()) % 2 == 0


async def agent_guided(client, row) -> None:
    """The guided mix (module docstring): a forced call in half of the episodes, the free agent in the rest."""
    if is_guided(client.traj.traj_id):
        return await agent_always_calls(client, row)
    return await run_episode(client, row, tool_on=True)
