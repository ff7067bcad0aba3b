"""`megarl advise`'s memory column: the plan's host bytes per node against the host memory given, on a GPU config."""
from __future__ import annotations

from megarl.advise.costs import planned_memory
from megarl.builder import load_run_config


def test_a_strategy_fits_while_its_planned_host_copies_fit_the_host_memory_given():
    cfg = load_run_config("configs/qwen3_30b_a3b_h100.yaml")
    plenty = planned_memory(cfg, [], host_memory_gb=10_000.0)["strategies"]
    # held copies: none for behav, one for interrupt_sync, eta + 1 = 3 for snapshot (plus the swap's transient one)
    need = {n: plenty[n]["host_gb_per_node"] for n in ("behav", "interrupt_sync", "snapshot")}
    assert need["behav"] == 0.0 < need["interrupt_sync"] < need["snapshot"]
    assert all(v["fits"] for n, v in plenty.items() if n != "dedicated")
    # the scorer holds all 30B weights on one GPU: 80.1 GB, past the 80 GB the config's GPUs have
    assert not plenty["dedicated"]["fits"] and plenty["dedicated"]["problems"][0].startswith("scorer GPU 80.")
    tight = planned_memory(cfg, [], host_memory_gb=need["interrupt_sync"])
    s = tight["strategies"]
    assert tight["device"] == "gpu" and s["interrupt_sync"]["fits"] and s["behav"]["fits"]
    assert not s["snapshot"]["fits"] and s["snapshot"]["problems"][0].startswith(f"host {need['snapshot']:.1f} GB")
    # the trainer GPU's own peak (megarl/launch/memory.py) is counted: below it nothing fits a GPU
    assert all(v["trainer_gpu_gb"] > 50 for v in s.values())
    small = planned_memory(load_run_config("configs/qwen3_30b_a3b_h100.yaml", ["placement.gpu_memory_gb=40"]), [],
                           host_memory_gb=10_000.0)["strategies"]
    assert not any(v["fits"] for v in small.values())
    assert "trainer GPU" in small["behav"]["problems"][0]
