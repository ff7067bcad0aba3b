"""An agent command for the agent_http end-to-end test: it first asks the endpoint without a key, with a made-up
key and with its own (status codes appended as a JSON line to the file named by its argument), then runs the example
calculator agent (configs/agents/calculator_agent.py) on the row it was given."""
import json
import os
import runpy
import sys
import urllib.error
import urllib.request
from pathlib import Path


def status(headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                                           headers=headers)) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


probe = {"no_key": status({}), "unknown_key": status({"Authorization": "Bearer megarl-made-up"}),
         "own_key": status({"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(probe) + "\n")
runpy.run_path(str(Path(__file__).resolve().parents[2] / "configs" / "agents" / "calculator_agent.py"),
               run_name="__main__")
