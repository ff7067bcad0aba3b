"""The trainer world's store admits only holders of the run's world key (megarl/trainer/world_store.py).

Two ranks under the real torchrun, with megatron's TP group, while a stranger probes from outside: torch's store
at MASTER_PORT (torchrun's, which takes any client) holds no key of the world's groups, and the world store
refuses the stranger, both as a torch TCPStore client and with a wrong key. The control: without a world key the
same stranger lists the world's keys in torch's store.
"""
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import DistNetworkError, TCPStore

from megarl.errors import EngineError
from megarl.rollout.client import free_port
from megarl.rollout.rendezvous import RendezvousStore

REPO = Path(__file__).resolve().parents[2]


def _world(tmp_path: Path, key: str | None):
    """Two ranks; the key, when given, in a 0600 file both read, as `megarl launch` hands it over."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGARL_WORLD_KEY")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if key:
        key_file = tmp_path / "world.key"
        key_file.write_text(key)
        key_file.chmod(0o600)
        env["MEGARL_WORLD_KEY_FILE"] = str(key_file)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             f"--master-port={port}", str(REPO / "tests/distributed/run_world_store.py"),
                             str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "READY").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    return proc, port, json.loads((tmp_path / "READY").read_text())["world_store"]


def _finish(proc, tmp_path: Path) -> None:
    (tmp_path / "DONE").write_text("")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


def _stranger_keys(port: int) -> list[str]:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return store.list_keys()


@pytest.mark.parametrize("keyed", [True, False])
def test_a_stranger_gets_nothing_of_a_keyed_world(tmp_path, keyed):
    proc, port, address = _world(tmp_path, "the-world-key-of-this-run" if keyed else None)
    try:
        keys = _stranger_keys(port)
        groups = [k for k in keys if "default_pg" in k or "/cpu/" in k]
        if not keyed:  # the control: torch's store shows the world's group keys to anyone
            assert address is None and groups, keys
            return
        assert address is not None and groups == [], keys
        assert not (tmp_path / "world.key").exists(), "every rank read it: the first rank of the node removes it"
        host, world_port = address
        with pytest.raises(EngineError, match="trainer world store .* refused this process's secret"):
            RendezvousStore(host, world_port, "00" * 16, timeout_s=10, label="trainer world store")
        with pytest.raises(DistNetworkError):  # torch's own client speaks no handshake: the server closes on it
            TCPStore(host, world_port, is_master=False, timeout=timedelta(seconds=5)).list_keys()
    finally:
        _finish(proc, tmp_path)
