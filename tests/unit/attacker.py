"""What code the policy writes might try against the run, as one script: each attempt is made for real and its
outcome reported (one key per attempt: "done" when it succeeded, else the error).

The plan (JSON, argv[1]) names the targets: "write": directories to plant a file in; "overwrite": files to open
for writing (a checkpoint's controller.pt, the stop marker); "read": files to read and directories to list;
"store": [host, port] of a torch TCPStore to write a key into; "endpoint": [host, port] that should answer;
"secrets": values to look for in its environment and in every /proc/<pid>/environ it can read. Printed as one
JSON line. Used by tests/unit/test_user_code_isolation.py and, as the agent command, by tests/e2e/attack_agent.py.
"""
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path


def attempt(fn):
    try:
        out = fn()
        return "done" if out is None else out
    except BaseException as e:  # noqa: BLE001 - every failure is an outcome
        return f"{type(e).__name__}: {e}"[:200]


def plant(d):
    path = os.path.join(d, f"planted_{uuid.uuid4().hex[:8]}.py")
    with open(path, "w") as f:
        f.write("raise SystemExit('planted code ran')\n")
    os.unlink(path)  # the attempt is the write; leave nothing behind where it succeeded


def overwrite(path):
    with open(path, "ab"):  # opened for writing is enough: the content is the attacker's from here
        pass


def read(path):
    if os.path.isdir(path):
        return f"done: {len(os.listdir(path))} entries"
    with open(path, "rb") as f:
        f.read()


def connect(address):
    socket.create_connection(tuple(address), timeout=5).close()


def store(address):
    connect(address)  # torch only once the port answers: an episode that cannot reach it pays no import
    import datetime

    from torch.distributed import TCPStore

    s = TCPStore(address[0], int(address[1]), is_master=False, timeout=datetime.timedelta(seconds=5))
    s.set("planted", "by the policy")
    return f"done: {s.num_keys()} keys"


def secrets_seen(values):
    blocks = {"own": "\n".join(f"{k}={v}" for k, v in os.environ.items())}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            blocks[entry.name] = (entry / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
    return sorted({v for v in values for b in blocks.values() if v in b})


def run(plan):
    out = {}
    for d in plan.get("write", []):
        out[f"write {d}"] = attempt(lambda d=d: plant(d))
    for p in plan.get("overwrite", []):
        out[f"overwrite {p}"] = attempt(lambda p=p: overwrite(p))
    for p in plan.get("read", []):
        out[f"read {p}"] = attempt(lambda p=p: read(p))
    if plan.get("store"):
        out["store"] = attempt(lambda: store(plan["store"]))
    if plan.get("endpoint"):
        out["endpoint"] = attempt(lambda: connect(plan["endpoint"]))
    out["remount /"] = attempt(lambda: subprocess.run(["mount", "-o", "remount,rw", "/"], check=True,
                                                      capture_output=True) and None)
    out["scratch /tmp"] = attempt(lambda: plant("/tmp"))
    out["env"] = sorted(k for k in os.environ if k.startswith(("MASTER_", "MEGARL_", "TORCHELASTIC_", "SLURM_")))
    out["secrets"] = secrets_seen(plan.get("secrets", []))
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
