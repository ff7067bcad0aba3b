"""What code the policy writes might try against the run, as one script: each attempt is made for real and its
outcome reported (JSON on stdout, one key per attempt: "done" when it succeeded, else the error).

argv[1] is JSON: {"write": [dirs to plant a file in], "read": [files to read], "tcp": [[host, port] to connect
to], "store": [host, port] of a torch TCPStore to list and write, "endpoint": [host, port] that should answer}.
Used by tests/unit/test_user_code_isolation.py and, as an agent command, by tests/e2e/test_attack_launch.py.
"""
import json
import os
import socket
import subprocess
import sys
import uuid


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


def read(path):
    with open(path, "rb") as f:
        f.read()


def connect(address):
    socket.create_connection(tuple(address), timeout=5).close()


def store(address):
    import datetime

    from torch.distributed import TCPStore

    s = TCPStore(address[0], int(address[1]), is_master=False, timeout=datetime.timedelta(seconds=5))
    s.set("planted", "by the policy")
    return f"done: {s.num_keys()} keys"


def main():
    plan = json.loads(sys.argv[1])
    out = {}
    for d in plan.get("write", []):
        out[f"write {d}"] = attempt(lambda d=d: plant(d))
    for p in plan.get("read", []):
        out[f"read {p}"] = attempt(lambda p=p: read(p))
    for a in plan.get("tcp", []):
        out[f"tcp {a[0]}:{a[1]}"] = attempt(lambda a=a: connect(a))
    if plan.get("store"):
        out["store"] = attempt(lambda: store(plan["store"]))
    if plan.get("endpoint"):
        out["endpoint"] = attempt(lambda: connect(plan["endpoint"]))
    out["remount /"] = attempt(lambda: subprocess.run(["mount", "-o", "remount,rw", "/"], check=True,
                                                      capture_output=True) and None)
    out["scratch /tmp"] = attempt(lambda: plant("/tmp"))
    out["env"] = sorted(k for k in os.environ if k.startswith(("MASTER_", "MEGARL_", "TORCHELASTIC_", "SLURM_")))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
