"""An agent command for the agent_http end-to-end test: it first asks the endpoint without a key, with a made-up
key, with its own and with the key of an episode that ended earlier (status codes appended as a JSON line to the
file named by its argument), then runs the example calculator agent (configs/agents/calculator_agent.py) on the row
it was given, and records its own key as ended when it is done.

An ended episode's command writes its key just before it exits, and megarl closes the session once it has seen the
exit, so the probe asks with that key until it is refused, for at most REFUSED_WITHIN_S: a key that is still
accepted then was never closed. (A fixed wait after the exit raced the session's closing on a loaded machine.)"""
import json
import os
import runpy
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: how long after an episode's command wrote its key at exit that key must be refused
REFUSED_WITHIN_S = 20.0


def status(headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                                           headers=headers)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def ended_key() -> tuple[str, float] | None:
    """The key of an episode whose command has exited and when it wrote it, if any."""
    path = Path(sys.argv[1])
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return next(((x["ended_key"], x["t"]) for x in lines if "ended_key" in x), None)


def status_once_refused(old: str, written: float) -> int:
    """The endpoint's answer to ``old``: 401 as soon as it refuses it, else its last answer REFUSED_WITHIN_S after
    ``written``."""
    while True:
        code = status({"Authorization": "Bearer " + old})
        if code == 401 or time.time() - written > REFUSED_WITHIN_S:
            return code
        time.sleep(0.05)


key = os.environ["OPENAI_API_KEY"]
probe = {"no_key": status({}), "unknown_key": status({"Authorization": "Bearer megarl-made-up"}),
         "own_key": status({"Authorization": "Bearer " + key})}
old = ended_key()
if old is not None:
    probe["finished_key"] = status_once_refused(*old)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(probe) + "\n")
try:
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "configs" / "agents" / "calculator_agent.py"),
                   run_name="__main__")
finally:
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"ended_key": key, "t": time.time()}) + "\n")
