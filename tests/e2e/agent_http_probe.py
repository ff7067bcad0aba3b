"""An agent command for the agent_http end-to-end test: it first asks the endpoint without a key, with a made-up
key, with its own and with the key of an episode that ended earlier (status codes appended as a JSON line to the
file named by its argument), then runs the example calculator agent (configs/agents/calculator_agent.py) on the row
it was given, and records its own key as ended when it is done."""
import json
import os
import runpy
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: an episode's key is taken for finished this long after its command wrote it at exit (megarl closes the session
#: when the command has exited: milliseconds)
SETTLED_S = 0.5


def status(headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                                           headers=headers)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def ended_key() -> str | None:
    """The key of an episode whose command exited at least SETTLED_S ago, if any."""
    path = Path(sys.argv[1])
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return next((x["ended_key"] for x in lines if "ended_key" in x and time.time() - x["t"] >= SETTLED_S), None)


key = os.environ["OPENAI_API_KEY"]
probe = {"no_key": status({}), "unknown_key": status({"Authorization": "Bearer megarl-made-up"}),
         "own_key": status({"Authorization": "Bearer " + key})}
old = ended_key()
if old is not None:
    probe["finished_key"] = status({"Authorization": "Bearer " + old})
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(probe) + "\n")
try:
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "configs" / "agents" / "calculator_agent.py"),
                   run_name="__main__")
finally:
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"ended_key": key, "t": time.time()}) + "\n")
