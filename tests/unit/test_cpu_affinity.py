"""placement.cpu_affinity: core lists, their checks, the vLLM bind string, and pinning a real process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.platform.cpu_affinity import check_affinity, check_cores, format_cores, omp_bind, parse_cores
from megarl.preflight import validate
from megarl.rollout.base import engine_options

REPO = Path(__file__).resolve().parents[2]
HF = {"vocab_size": 16, "max_position_embeddings": 128}


def test_core_lists_parse_and_format():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores("5") == [5]
    assert format_cores([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cores([1]) == "1" and format_cores([0, 2, 4]) == "0,2,4"
    for bad in ("a", "3-1", "1,,2", ""):
        with pytest.raises(ConfigError, match=r"--cpu-cores=.* is not a core list; write it like 0-3,6"):
            parse_cores(bad, "--cpu-cores")


def test_cores_must_exist_and_be_distinct():
    check_cores([0, 1], "x", available={0, 1, 2})
    with pytest.raises(ConfigError, match=r"placement\.cpu_affinity\.engines=\[1, 7\]: core\(s\) 7 are not available "
                                          r"to this process \(available: 0-1\)"):
        check_cores([1, 7], "placement.cpu_affinity.engines", available={0, 1})
    with pytest.raises(ConfigError, match=r"x=\[1, 1\] names a core twice"):
        check_cores([1, 1], "x", available={0, 1})


def test_config_section_and_preflight_check():
    cfg = load_run_config(None, ["placement.cpu_affinity.trainer=[0]", "placement.cpu_affinity.engines=[1]"])
    assert cfg.placement.cpu_affinity.trainer == [0] and cfg.placement.cpu_affinity.engines == [1]
    check_affinity(cfg.placement.cpu_affinity, available={0, 1})
    with pytest.raises(ConfigError, match=r"unknown config key placement\.cpu_affinity\.engine; did you mean "
                                          r"placement\.cpu_affinity\.engines\?"):
        load_run_config(None, ["placement.cpu_affinity.engine=[1]"])
    with pytest.raises(ConfigError, match=r"cpu_affinity\.trainer\[0\]='0' has the wrong type: expected int"):
        load_run_config(None, ["placement.cpu_affinity.trainer=['0']"])
    far = max(os.sched_getaffinity(0)) + 1000  # a core no machine here has
    with pytest.raises(ConfigError, match=rf"placement\.cpu_affinity\.trainer=\[{far}\]: core\(s\) {far} are not"):
        validate(load_run_config(None, [f"placement.cpu_affinity.trainer=[{far}]"]), HF)


def test_pinning_to_a_core_the_machine_lacks_is_a_config_error():
    from megarl.platform.cpu_affinity import machine_cores, pin_process

    far = max(machine_cores()) + 1000
    with pytest.raises(ConfigError, match=rf"cannot run on core\(s\) {far}: .*; this process may use"):
        pin_process([far])  # fails before anything changes: this process keeps its cores


def test_engine_cores_set_its_threads():
    assert engine_options("vllm", 1, 1, [2, 3]) == {"cpu_threads": 2, "cpu_cores": [2, 3], "kv_cache_gib": 1}
    assert engine_options("hf", 1, 4) == {"cpu_threads": 4}


def test_omp_bind_splits_cores_over_tensor_parallel_workers():
    assert omp_bind([1]) == "1"
    assert omp_bind([3, 0, 1, 2], 2) == "0-1|2-3"
    assert omp_bind([0, 1, 2], 2) == "nobind"  # uneven: the workers inherit the engine's pinning instead
    assert omp_bind([], 1) == "nobind"


_CHILD = r"""
import json, os, subprocess, sys, threading, time
from pathlib import Path
import torch
from megarl.platform import cpu_affinity
before = threading.Thread(target=time.sleep, args=(3,)); before.start()   # a thread started before pinning
cpu_affinity.pin_process([int(sys.argv[1])])
threads = {t.name: sorted(os.sched_getaffinity(int(t.name))) for t in Path("/proc/self/task").iterdir()}
child = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(2)"])
worker = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(2)"])
cpu_affinity.release(worker.pid)
# an engine started by the pinned trainer moves itself to its own core, outside the one it inherited
moved = subprocess.run([sys.executable, "-c", "import os; from megarl.platform import cpu_affinity; "
                        f"cpu_affinity.pin_process([{sys.argv[2]}]); print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout.strip()
out = {"moved": moved, "threads": threads, "torch_threads": torch.get_num_threads(),
       "child": sorted(os.sched_getaffinity(child.pid)), "worker": sorted(os.sched_getaffinity(worker.pid)),
       "available": sorted(cpu_affinity.available_cores())}
child.kill(); worker.kill()
print(json.dumps(out))
"""


def test_pin_process_pins_every_thread_and_children_and_release_undoes_it():
    cores = sorted(os.sched_getaffinity(0))
    core, other = cores[-1], cores[0]
    p = subprocess.run([sys.executable, "-c", _CHILD, str(core), str(other)], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["threads"]) >= 2 and all(v == [core] for v in out["threads"].values())  # the earlier thread too
    assert out["torch_threads"] == 1  # one intra-op thread per core, whatever OMP_NUM_THREADS said
    assert out["child"] == [core]  # a process it starts inherits the pinning
    assert out["worker"] == cores and out["available"] == cores  # a released worker gets every core back
    assert out["moved"] == str([other])
