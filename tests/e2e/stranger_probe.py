"""A stranger on the cluster network: a host that is not part of the run and holds none of its keys.

Run on that host: ``python stranger_probe.py [--on-stdin] ENGINE_HOST:PORT RENDEZVOUS_HOST:PORT
SCORER_HOST:PORT [AGENT_HOST:PORT]`` (``-`` skips a target). With ``--on-stdin`` it loads, prints ``ready``,
and probes when a line comes on stdin, so a probe meant for a running job does not spend the job's last
seconds importing. Every attempt has a deadline of a few seconds (so a listener that kept the stranger
waiting shows as a hang here, not as a refusal); prints one JSON object: per target, each attempt and how
it ended, and the counts of attempts and refusals. A refusal is a 401, a closed or failed handshake, or a
connection refused; anything the stranger got (an answer, a handshake passed) is ``accepted``.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

from megarl.errors import EngineError
from megarl.rollout.rendezvous import RendezvousStore

DEADLINE_S = 5.0


def _http(url: str, body: dict, key: str | None) -> str:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return f"accepted {resp.status}"
    except urllib.error.HTTPError as e:
        return f"refused {e.code}" if e.code in (401, 403) else f"accepted {e.code}"
    except ConnectionRefusedError:
        return "refused connection"
    except urllib.error.URLError as e:
        return "refused connection" if isinstance(e.reason, ConnectionRefusedError) else f"error {e.reason}"


def engine(addr: str) -> list[str]:
    base = f"http://{addr}"
    return [_http(f"{base}/generate", {"prompt_ids": [1, 2, 3], "max_new_tokens": 4}, None),
            _http(f"{base}/generate", {"prompt_ids": [1, 2, 3], "max_new_tokens": 4}, os.urandom(24).hex()),
            _http(f"{base}/update_weights", {"version": 99, "path": "/tmp/stranger-weights"}, None),
            _http(f"{base}/update_weights", {"version": 99, "path": "/tmp/stranger-weights"}, os.urandom(24).hex())]


def rendezvous(addr: str) -> list[str]:
    host, port = addr.rsplit(":", 1)
    try:
        store = RendezvousStore(host, int(port), os.urandom(32).hex(), timeout_s=DEADLINE_S)
    except EngineError as e:
        return [f"refused {type(e.__cause__).__name__ if e.__cause__ else 'handshake'}"]
    try:
        store.set("megarl/stranger", b"x")
        return ["accepted write"]
    finally:
        store.close()


def scorer(addr: str) -> list[str]:
    host, port = addr.rsplit(":", 1)
    try:
        conn = Client((host, int(port)), authkey=os.urandom(16))
    except AuthenticationError:
        return ["refused authentication"]
    except (ConnectionError, EOFError, OSError) as e:
        return [f"refused {type(e).__name__}"]
    conn.close()
    return ["accepted handshake"]


def agent(addr: str) -> list[str]:
    body = {"model": "megarl", "messages": [{"role": "user", "content": "hi"}]}
    guessed = f"megarl-{os.urandom(32).hex()}"  # shaped like an episode's key
    return [_http(f"http://{addr}/v1/chat/completions", body, None),
            _http(f"http://{addr}/v1/chat/completions", body, "sk-stranger"),
            _http(f"http://{addr}/v1/chat/completions", body, guessed),
            _http(f"http://{addr}/sessions", {}, os.urandom(24).hex()),  # claim an episode: the service key
            _http(f"http://{addr}/sessions/{guessed}/reward", {"reward": 1.0}, guessed)]


def main(argv: list[str]) -> None:
    if argv[:1] == ["--on-stdin"]:
        argv = argv[1:]
        print("ready", flush=True)
        sys.stdin.readline()
    socket.setdefaulttimeout(DEADLINE_S)
    report: dict = {"targets": {}}
    started = time.monotonic()
    for name, probe, addr in zip(("engine", "rendezvous", "scorer", "agent"), (engine, rendezvous, scorer, agent),
                                 argv):
        if addr == "-":  # not probed
            continue
        t0 = time.monotonic()
        report["targets"][name] = {"addr": addr, "results": probe(addr), "seconds": round(time.monotonic() - t0, 2)}
    results = [r for t in report["targets"].values() for r in t["results"]]
    report.update(attempts=len(results), refused=sum(r.startswith("refused") for r in results),
                  seconds=round(time.monotonic() - started, 2))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
