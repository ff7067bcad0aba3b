"""A run's engines answer only callers that hold the run's key (a bearer token from MEGARL_ENGINE_KEY).

A real HF engine process as the trainer starts it (launch_engine_process): every endpoint refuses a request
without the key, or with another one, with 401 and changes nothing; the run's own client works; the key is
in the engine's environment, never on its command line.
"""
import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.rollout.engine_key import ENGINE_KEY_ENV

REPO = Path(__file__).resolve().parents[2]
GENERATE = {"request_id": "x", "prompt_ids": [1, 5, 6], "sampling": {"max_new_tokens": 4}}


def _status(url: str, body: dict | None, key: str | None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_engine_refuses_requests_without_the_run_key(tmp_path, monkeypatch):
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.client import launch_engine_process, stop_engine_process

    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "v0", seed=0)
    other = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "v1", seed=1)
    proc, client = launch_engine_process(str(ckpt), "hf", log_path=str(tmp_path / "engine.log"))
    try:
        url = client.url
        calls = [("/generate", GENERATE), ("/abort_all", {}), ("/pause", {}), ("/resume", {}),
                 ("/update_weights", {"version": 7, "path": str(other)}), ("/version", None), ("/health", None)]
        for path, body in calls:
            for key in (None, "not-the-key"):
                status, reply = _status(url + path, body, key)
                assert status == 401, (path, key, status, reply)
                assert reply["type"] == "EngineError" and ENGINE_KEY_ENV in reply["error"], reply
        assert asyncio.run(client.version()) == 0, "a refused /update_weights changed nothing"
        key = client.key  # the engine got it through a pipe: neither its command line nor its environment has it
        assert len(key) >= 32 and key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert key.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert _status(url + "/version", None, key) == (200, {"version": 0})
    finally:
        stop_engine_process(proc)


def test_an_engine_serving_beyond_this_host_needs_a_key(monkeypatch):
    from megarl.rollout.server import serve

    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"{ENGINE_KEY_ENV} is not set"):
        asyncio.run(serve("unused", "hf", host="0.0.0.0", port=0))
