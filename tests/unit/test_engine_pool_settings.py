"""EnginePool: engines are shared only by runs with the same launch arguments; a dead one is started again."""
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.rollout import engine_pool
from megarl.rollout.engine_key import ENGINE_KEY_ENV
from megarl.rollout.engine_pool import ConnectedEngines, EnginePool


class FakeProc:
    def __init__(self, n):
        self.pid, self.rc = 1000 + n, None

    def poll(self):
        return self.rc


class FakeClient:
    def __init__(self, n):
        self.url, self.key = f"http://127.0.0.1:{9000 + n}", "k"


@pytest.fixture
def launched(monkeypatch):
    """Every (launch kwargs, log path) the pool started; stopped procs get return code -15."""
    calls, stopped = [], []

    def launch(log_path, **kw):
        calls.append((kw, Path(log_path).name))
        return FakeProc(len(calls)), FakeClient(len(calls))

    def stop(proc, timeout_s=30.0, wait=True):
        stopped.append(proc.pid)
        proc.rc = -15

    monkeypatch.setattr(engine_pool, "launch_engine_process", launch)
    monkeypatch.setattr(engine_pool, "stop_engine_process", stop)
    return calls, stopped


def cfg(*overrides):
    return load_run_config("configs/tiny_cpu.yaml", ["rollout.n_engines=2", *overrides])


def test_same_settings_share_the_engines_other_settings_get_their_own(launched, tmp_path):
    calls, stopped = launched
    with EnginePool(tmp_path) as pool:
        for _ in range(2):  # two runs of one config: engines 0 and 1 start once
            pool.use(cfg(), Path("/m"))
            urls = [pool.engine(i)[1].url for i in range(2)]
        assert urls == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"] and len(calls) == 2 and not stopped
        # one key for all: a run in another process reaches every engine with it
        assert [kw["env"][ENGINE_KEY_ENV] for kw, _ in calls] == [pool.key, pool.key] and pool.key
        pool.use(cfg("rollout.dtype=bfloat16"), Path("/m"))  # another engine dtype: new engines
        assert stopped == [1001, 1002]
        assert pool.engine(0)[1].url == "http://127.0.0.1:9003"
        assert calls[2][0]["extra_args"] == ["--dtype", "bfloat16"] and calls[2][1] == "engine0.launch1.log"
        pool.use(cfg("rollout.dtype=bfloat16"), Path("/other_model"))  # another model: new engines again
        assert stopped == [1001, 1002, 1003] and pool.engine(0)[1].url == "http://127.0.0.1:9004"
        assert calls[3][0]["checkpoint"] == "/other_model"
    assert stopped == [1001, 1002, 1003, 1004]  # the end of the pool stops what runs


def test_a_dead_engine_is_started_again_and_the_run_gets_no_process(launched, tmp_path):
    calls, stopped = launched
    with EnginePool(tmp_path) as pool:
        pool.use(cfg(), Path("/m"))
        proc_for_run, _ = pool.engine(0)
        assert proc_for_run is None  # the run's supervisor must never stop a pooled engine
        pool._engines[0][0].rc = 1  # it died between runs
        assert pool.engine(0)[1].url == "http://127.0.0.1:9002"
        assert [name for _, name in calls] == ["engine0.log", "engine0.launch1.log"]
        assert pool.relaunch(0)[1].url == "http://127.0.0.1:9003"  # the supervisor's restart during a run
        assert stopped == [1001, 1002]


def test_connected_engines_must_be_as_many_as_the_run_wants():
    engines = ConnectedEngines(["http://127.0.0.1:9001"])
    engines.use(cfg("rollout.n_engines=1"), Path("/m"))
    assert engines.engine(0)[1].url == "http://127.0.0.1:9001" and engines.relaunch is None
    with pytest.raises(ConfigError, match=r"1 pooled engine\(s\) given for rollout.n_engines=2"):
        engines.use(cfg(), Path("/m"))
