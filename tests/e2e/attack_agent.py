"""The agent command of tests/e2e/test_fault_schedule_launch.py: before it answers, it makes every attempt of
tests/unit/attacker.py with the plan in the file named by argv[2] (the run's checkpoints, source tree, Python
environment, stop marker, the trainer world's store, the checkpoint key, the run's secrets), writes what came of
each to a new file in the directory argv[1] (atomically: a command stopped mid-write leaves no partial report),
then runs the example calculator agent (configs/agents/calculator_agent.py) on its row."""
import importlib.util
import json
import os
import runpy
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("attacker", ROOT / "tests" / "unit" / "attacker.py")
attacker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(attacker)

report = attacker.run(json.loads(Path(sys.argv[2]).read_text()))
name = f"attack_{uuid.uuid4().hex}.json"
tmp = Path(sys.argv[1]) / f".{name}.tmp"
tmp.write_text(json.dumps(report))
os.replace(tmp, Path(sys.argv[1]) / name)
runpy.run_path(str(ROOT / "configs" / "agents" / "calculator_agent.py"), run_name="__main__")
