"""Agents: an OpenAI-style chat client over megarl's engines (client.py), tool calls (tool_calls.py), tools (tools.py),
and the OpenAI-compatible HTTP endpoint for agents in other processes (http_server.py, http_requests.py,
http_service.py, on what they share: http_session.py).

The workflows that run an agent episode per trajectory are megarl/workflows/agent.py and agent_http.py.
"""
