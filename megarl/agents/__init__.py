"""Agents: an OpenAI-style chat client over megarl's engines (client.py), tool calls (tool_calls.py), tools (tools.py).

The workflow that runs an agent episode per trajectory is megarl/workflows/agent.py.
"""
