"""The `agent` section of the configuration schema (megarl/config/schema.py holds the rest; the same rules:
one docstring per field, validated by :mod:`megarl.config.loader`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class AgentConfig:
    """Agent episodes: a user's `async def agent(client, row)` against an OpenAI-style chat client (rollout.workflow=agent, megarl/workflows/agent.py), or a command in another process against megarl's OpenAI-compatible endpoint (rollout.workflow=agent_http, megarl/workflows/agent_http.py)."""

    fn: str = "math_python"
    """The agent: a built-in name (math_python) or a dotted path pkg.mod:agent to an `async def agent(client, row) -> float | None` (None: the reward service scores the final answer)."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: built-in names (python: sandboxed code execution) or dotted paths to functions `fn(**arguments) -> str`."""
    max_turns: int = 8
    """Completions per episode; an agent asking for more fails its episode (counted in n_agent_failed)."""
    max_tokens: int = 0
    """Token budget of one trajectory (prompt, turns and tool results); 0 = the model's max_position_embeddings."""
    turns: Literal["auto", "individual"] = "auto"
    """auto: turns that extend the conversation token-exactly stay one trajectory, a turn whose template rewrites the past starts a new one; individual: every completion is a trajectory of its own. All of an episode's trajectories share its reward."""
    tool_timeout_s: float = 10.0
    """Time limit of one tool call (it runs in a worker process); past it the model gets an error message."""
    tool_memory_mb: int = 512
    """Memory one tool call may allocate in its worker process."""
    n_tool_workers: int = 2
    """Worker processes running tool calls."""
    command: str = ""
    """rollout.workflow=agent_http: the program run once per episode (shell-split, no shell), with the data row as JSON on stdin and OPENAI_BASE_URL / OPENAI_API_KEY in its environment; the last line of its stdout is the final answer (scored by reward.fn) or a JSON object {"reward": r}."""
    timeout_s: float = 300.0
    """rollout.workflow=agent_http: time limit of one episode's command (killed past it) or of an agent service's episode (agent.serve); past it the episode fails (n_agent_failed)."""
    http_host: str = "127.0.0.1"
    """Address megarl's OpenAI-compatible agent endpoint listens on (rollout.workflow=agent_http); 0.0.0.0 exposes it on the cluster network (each episode's API key is its only authorization)."""
    http_port: int = 0
    """Port of the agent endpoint; 0 = a free port (the command learns it from OPENAI_BASE_URL)."""
    strict_model_name: bool = False
    """false: the agent endpoint serves the run's policy under any model name a request sends (an agent written for another OpenAI endpoint keeps its own; a response's model field names the run's model); true: a request naming another model than the run's (GET /v1/models) gets 404 model_not_found."""
    serve: bool = False
    """rollout.workflow=agent_http without a command: each episode waits for a long-lived agent service, which claims it with POST /sessions (Authorization: Bearer $MEGARL_AGENT_SERVICE_KEY; it gets the row and the episode's key) and ends it with POST /sessions/<key>/reward ({"reward": r} or {"answer": text}) within agent.timeout_s; needs a fixed agent.http_port."""
    rows_from_service: bool = False
    """agent.serve=true: the run's prompts are the rows the agent service posts (POST /sessions {"row": {...}}, checked like data rows; each is rolled out as one group and the answer holds its episodes' keys) instead of data.path, which stays empty."""
    row_wait_s: float = 60.0
    """agent.rows_from_service: how long a posted row waits for the staleness gate to admit its group; past it the request gets 503 with Retry-After and the row is not rolled out."""
    command_memory_mb: int = 8192
    """agent.command: address space (virtual memory) one episode's process may map (RLIMIT_AS; a process past it fails its allocations and its episode); 0 = no limit."""
    command_cpu_s: int = 600
    """agent.command: CPU seconds one episode's process may use (RLIMIT_CPU; it is killed past it and its episode fails); 0 = no limit."""
    command_open_files: int = 1024
    """agent.command: open file descriptors one episode's process may hold (RLIMIT_NOFILE); 0 = inherit megarl's. Core dumps are always off."""
    command_network: Literal["endpoint", "host"] = "endpoint"
    """agent.command's network: endpoint (the default) gives each command an empty network namespace in which 127.0.0.1 on the endpoint's port (OPENAI_BASE_URL) reaches megarl's agent endpoint and nothing else reaches anything; host shares this machine's network (the command can then also reach every port of the run's processes: engines, the trainer world's store, the gloo transport; use it only for agents that need the internet). Either way the filesystem is read-only with the run directory hidden (docs/threat_model.md)."""
    command_writable: list[str] = field(default_factory=list)
    """agent.command: directories (they must exist) that every episode's command may write besides its private /tmp, e.g. a folder for its artifacts; the rest of the filesystem is read-only to it and the run directory is hidden, also inside these."""
    command_allow_unisolated: bool = False
    """agent.command runs in a PID namespace of its own without capabilities (it cannot read the run's processes or other episodes' keys); where this machine cannot make one the run refuses to start. true: run commands anyway, able to read this user's other processes (a warning is logged)."""
