"""The plan's checkpoint terms (megarl/launch/save_plan.py) and its runtime reserve (megarl/launch/runtime_reserve.py),
by hand on the shipped GPU layouts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.launch import cluster, runtime_reserve, save_plan
from megarl.launch.memory import GB, memory_plan
from megarl.launch.placement import load_hf_config, param_counts, resolve_plan

ROOT = Path(__file__).resolve().parents[2]
B30 = ROOT / "configs/qwen3_30b_a3b_h100.yaml"


def planned(config: Path, nodes: int, overrides: list[str] | None = None):
    cfg = load_run_config(config, overrides or [])
    hf, _ = load_hf_config(cfg)
    return cfg, hf, resolve_plan(cfg, hf, cluster.simulated(nodes, 8))


def test_a_30b_checkpoint_by_hand():
    cfg, hf, plan = planned(B30, 4, ["parallel.tp=1", "parallel.sequence_parallel=false"])  # EP8 x DP16, expert DP2
    sp = save_plan.save_plan(cfg, hf, plan, disk_gb_s=2.0, signal_lead_s=240)
    total = param_counts(hf)[0]
    assert sp.total_bytes == pytest.approx(total * (2 + 12), rel=1e-9)  # bf16 weights + 12 B of optimizer
    assert sp.total_bytes / GB == pytest.approx(427.4, abs=0.1)
    # expert DP rank 0 of every expert shard, and DP rank 0, are on node 1: it writes all of the optimizer
    opt = sp.total_bytes - sp.weight_bytes
    assert sp.node_write_bytes[0] > opt and sum(sp.node_write_bytes) == pytest.approx(sp.total_bytes)
    assert sp.write_s == pytest.approx(sp.node_write_bytes[0] / 2e9)
    assert sp.stop_budget_s == 150.0  # logging.stop_grace_s of the shipped config
    (problem,) = sp.problems
    assert "logging.stop_grace_s=240" in problem and "--signal=B:USR1@300" in problem
    assert sp.node_gather_bytes[0] == pytest.approx(opt)  # the gathered optimizer is held on node 1's host
    cfg.placement.host_memory_gb = 500  # the gather fits alone, not beside a 200 GB host plan
    assert not save_plan.save_plan(cfg, hf, plan, 2.0, 240).problems[1:]
    crowded = save_plan.save_plan(cfg, hf, plan, 2.0, 240, host_bytes=200 * GB).problems
    assert len(crowded) == 2 and "beside the 200.0 GB the host plan holds" in crowded[1]


def test_the_shipped_30b_layout_writes_its_stop_checkpoint_within_its_budget():
    cfg, hf, plan = planned(B30, 4)
    sp = save_plan.save_plan(cfg, hf, plan, disk_gb_s=2.0)
    assert sp.problems == [] and sp.write_s < sp.stop_budget_s <= cfg.logging.stop_grace_s
    assert save_plan.shipped_signal_lead_s() - save_plan.STOP_MARGIN_S >= cfg.logging.stop_grace_s
    short = save_plan.save_plan(cfg, hf, plan, disk_gb_s=2.0, signal_lead_s=150)
    assert short.stop_budget_s == 90 and short.problems and short.warnings  # periodic saves: warned as well


def test_the_runtime_reserve_counts_nccl_and_the_sender_on_rank_0():
    cfg, hf, plan = planned(B30, 4)
    t = plan.trainer
    assert (t.tp, t.ep, t.dp, t.expert_dp) == (2, 8, 8, 1)
    # the world, DP8, TP2 and EP8: 4 x 1.6 GB, capped at 6 GB (NVIDIA/nccl issue 864)
    assert runtime_reserve.trainer_communicators(t) == 4
    parts = runtime_reserve.runtime_parts(cfg, plan)
    assert parts["NCCL"] == 6e9
    # the sender: its context, the group + 4 sub-groups (engines of TP4, cut per worker) capped, 2 x 1024 MB buckets
    assert parts["weight sender"] == pytest.approx(0.6e9 + 6e9 + 2 * (1024 << 20))
    mem = memory_plan(cfg, hf, plan)
    assert mem.gpus[0].parts["runtime"] == pytest.approx(sum(parts.values()))
    assert mem.gpus[0].parts["runtime"] > 3 * 5e9  # over five times the former flat 3 GB
    disk = load_run_config(B30, ["rollout.weight_sync=disk"])
    assert "weight sender" not in runtime_reserve.runtime_parts(disk, plan)


def test_plan_prints_the_checkpoint_and_refuses_a_stop_that_cannot_finish():
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "--config", str(B30), "--nodes", "4",
                               "--gpus-per-node", "8", *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)
    ok = run("--cost")
    assert ok.returncode == 0, ok.stderr
    assert "427.4 GB per checkpoint" in ok.stdout and "write time 111 s" in ok.stdout
    assert "weight sender" in ok.stdout and "NCCL 6.0" in ok.stdout
    short = run("--signal-lead-s", "150")
    assert short.returncode == 1 and "a stop checkpoint writes" in short.stderr
    assert "logging.stop_grace_s=" in short.stderr and "--signal=B:USR1@" in short.stderr
