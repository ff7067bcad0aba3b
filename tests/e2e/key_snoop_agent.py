"""An agent command for tests/e2e/test_fault_schedule_launch.py that tries to steal the run's secrets before it
answers: it reads its own environment and every /proc/<pid>/environ it can open, writes one JSON line with what it
found (every variable value, so the test can look for its keys) to a file in the directory named by its argument
(written whole to a temp name, then renamed: a command stopped mid-write leaves ``.snoop_*.json.tmp``, never a
partial report), then runs the example calculator agent (configs/agents/calculator_agent.py) on the row it was given."""
import json
import os
import runpy
import sys
import uuid
from pathlib import Path

found = {"pid": os.getpid(), "own_env": dict(os.environ), "readable": {}, "unreadable": 0}
for entry in Path("/proc").glob("[0-9]*"):
    try:
        block = (entry / "environ").read_bytes()
    except OSError:
        found["unreadable"] += 1
        continue
    found["readable"][entry.name] = block.decode(errors="replace")
name = f"snoop_{uuid.uuid4().hex}.json"
tmp = Path(sys.argv[1]) / f".{name}.tmp"  # a command stopped mid-write leaves this, never a partial report
tmp.write_text(json.dumps(found))
os.replace(tmp, tmp.with_name(name))
runpy.run_path(str(Path(__file__).resolve().parents[2] / "configs" / "agents" / "calculator_agent.py"),
               run_name="__main__")
