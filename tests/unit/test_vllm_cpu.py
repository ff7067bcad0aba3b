"""The environment and engine arguments of a vLLM CPU engine (megarl/rollout/vllm_cpu.py); the real engine
starting with them is tests/e2e/test_vllm_engine.py."""
import pytest

from megarl.rollout.vllm_cpu import cpu_engine_setup


@pytest.fixture(autouse=True)
def _no_inherited(monkeypatch):
    for name in ("TORCHDYNAMO_DISABLE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)


def test_one_unbound_worker_runs_in_the_engine_core_process():
    env, kwargs = cpu_engine_setup(max_model_len=1024, tensor_parallel_size=1, cpu_cores=None, kv_cache_gib=2,
                                   cpu_threads=1)
    assert env == {"TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "2",
                   "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert kwargs == {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048,
                      "distributed_executor_backend": "uni"}


@pytest.mark.parametrize("tp,cores", [(2, None), (1, [1]), (2, [0, 1])])
def test_bound_threads_and_tensor_parallel_workers_keep_vllms_worker_processes(tp, cores):
    env, kwargs = cpu_engine_setup(max_model_len=4096, tensor_parallel_size=tp, cpu_cores=cores, kv_cache_gib=None,
                                   cpu_threads=0)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "distributed_executor_backend" not in kwargs
    assert kwargs["max_num_batched_tokens"] == 4096  # the longest prompt fits one step
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ({None: "nobind", (1,): "1", (0, 1): "0|1"}[tuple(cores or ()) or None])
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_a_set_environment_wins(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env, _ = cpu_engine_setup(max_model_len=128, tensor_parallel_size=1, cpu_cores=None, kv_cache_gib=1, cpu_threads=1)
    assert env["TORCHDYNAMO_DISABLE"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
