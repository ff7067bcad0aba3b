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
    assert all(v["fits"] for v in plenty.values())
    # the scorer holds all 30B weights on one GPU and a 9216-token row's logits: 78.1 GB of the config's 80 GB;
    # with 16384-token scorer micro-batches 89.0 GB, past them
    assert round(plenty["dedicated"]["dedicated_gpu_gb"], 1) == 78.1
    wide = load_run_config("configs/qwen3_30b_a3b_h100.yaml", ["recovery.dedicated.micro_batch_tokens=16384"])
    big = planned_memory(wide, [], host_memory_gb=10_000.0)["strategies"]["dedicated"]
    assert not big["fits"] and big["problems"][0].startswith("scorer GPU 89.0 GB > 80 GB")
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
