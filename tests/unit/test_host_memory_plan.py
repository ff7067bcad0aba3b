"""The host memory plan of a trainer node (megarl/launch/host_memory.py) and its refusal by `megarl plan` / `launch`.

The numbers are counted by hand for a made-up model and layout: 254,656 parameters (tests/unit/test_memory_plan.py
counts them), tp 2 (a rank's shard: 127,328 parameters), 4 trainer ranks per node on 2 nodes, dp 4, bf16.
"""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import MegaRLConfig
from megarl.launch import host_memory

ROOT = Path(__file__).resolve().parents[2]
HF = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "vocab_size": 1000, "intermediate_size": 100, "max_position_embeddings": 4096, "tie_word_embeddings": False}
PARAMS = 254_656
SHARD = PARAMS // 2  # tp 2
RPN = 4
#: one bf16 copy of every rank's shard on a node: 127,328 x 2 B x 4 ranks
COPY_SET = 1_018_624
#: the broadcast publish: two bf16 exports of the whole model (2 x 254,656 x 2 B) and one 1 MB bucket
PUBLISH = 2 * 509_312 + 1_048_576


def config(strategy="snapshot", eta=2, limit=0.0, async_save=False, weight_sync="broadcast"):
    cfg = MegaRLConfig()
    cfg.model.dtype = "bfloat16"
    cfg.parallel.use_distributed_optimizer = True
    cfg.recovery.name = strategy
    cfg.rollout.eta, cfg.rollout.weight_sync, cfg.rollout.bucket_mb = eta, weight_sync, 1
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 100, 400
    cfg.placement.device, cfg.placement.host_memory_gb = "gpu", limit
    cfg.logging.async_save = async_save
    return cfg


def plan(device="gpu"):
    trainer = SimpleNamespace(hosts=("n0", "n1"), ranks_per_node=RPN, world_size=8, tp=2, pp=1, ep=1, dp=4,
                              expert_dp=4, sequence_parallel=False)
    return SimpleNamespace(device=device, trainer=trainer, engines=[SimpleNamespace(tp=1)] * 2, dedicated=None)


def test_terms_by_hand():
    snap = host_memory.host_memory(config(), HF, plan())
    # eta 2: 3 kept versions (the current one among them: a swap restores from it, nothing more is saved)
    assert snap.recovery_copies == 3 * COPY_SET == 3_055_872
    assert snap.publish_buckets == PUBLISH == 2_067_200
    assert snap.async_save_copies == snap.async_save_strategy_copies == 0
    assert snap.total == 3_055_872 + 2_067_200 and snap.other_nodes == 3_055_872
    assert snap.problems == []  # host_memory_gb 0: not checked
    # ewma: its bf16 average (127,328 x 2 B x 4 ranks) and the swap's bf16 copy; with phi_dtype=float32 its
    # fp32 average (127,328 x 4 B x 4 ranks); with phi_on_gpu nothing on the host
    assert host_memory.host_memory(config("ewma"), HF, plan()).recovery_copies == 2 * COPY_SET
    cfg = config("ewma")
    cfg.recovery.options["ewma"] = {"phi_dtype": "float32"}
    assert host_memory.host_memory(cfg, HF, plan()).recovery_copies == 2_037_248 + COPY_SET
    cfg.recovery.options["ewma"] = {"phi_on_gpu": True}
    assert host_memory.host_memory(cfg, HF, plan()).recovery_copies == 0
    assert host_memory.host_memory(config("loglinear"), HF, plan()).recovery_copies == 0
    # the disk publisher holds one export, no bucket
    assert host_memory.host_memory(config(weight_sync="disk"), HF, plan()).publish_buckets == 509_312
    # snapshot on disk: the version read back and use_params' copy
    cfg = config()
    cfg.recovery.options["snapshot"] = {"storage": "disk"}
    assert host_memory.host_memory(cfg, HF, plan()).recovery_copies == 2 * COPY_SET


def test_async_save_adds_its_copies():
    base = host_memory.host_memory(config(), HF, plan())
    on = host_memory.host_memory(config(async_save=True), HF, plan())
    # per rank: bf16 weights 127,328 x 2 = 254,656 B, fp32 main + 2 moments over dp 4: 12 x 127,328 / 4 = 381,984 B
    assert on.async_save_copies == (254_656 + 381_984) * RPN == 2_546_560
    # and the strategy's kept state: snapshot's 3 versions
    assert on.async_save_strategy_copies == 3 * COPY_SET
    assert on.total == base.total + 2_546_560 + 3_055_872
    assert on.other_nodes == on.total - PUBLISH


def test_refused_when_host_memory_gb_is_too_small_naming_the_key():
    # 5,123,072 B planned > 5,000,000
    hm = host_memory.host_memory(config(limit=0.005), HF, plan())
    assert len(hm.problems) == 1
    problem = hm.problems[0]
    assert "host memory of a trainer node" in problem and "placement.host_memory_gb=0.005" in problem
    # each single fix named was checked: disk storage 2 x 1,018,624 + 2,067,200 = 4,104,448 B fits, and so does
    # eta 1 (2 copies: 4,104,448 B)
    assert "recovery.snapshot.storage=disk" in problem and "rollout.eta=1" in problem
    assert "recovery.name=" in problem and "placement.trainer_ranks" in problem
    assert "DOES NOT FIT: host memory" in hm.describe()
    # 5,123,072 B fits 0.007 GB; async save (+2,546,560 + 3,055,872 B) does not, and switching it off is named
    assert host_memory.host_memory(config(limit=0.007), HF, plan()).problems == []
    over = host_memory.host_memory(config(limit=0.007, async_save=True), HF, plan())
    assert "logging.async_save=false" in over.problems[0]


def test_no_check_at_zero_and_cpu_configs_are_not_planned():
    assert host_memory.host_memory(config(limit=0.0), HF, plan()).problems == []
    cpu = config()
    cpu.placement.device = "cpu"
    assert host_memory.planned(cpu, HF, plan("cpu")) is None
    cpu.placement.host_memory_gb = 0.001
    assert host_memory.planned(cpu, HF, plan("cpu")).problems  # set on cpu: checked there too
    with pytest.raises(Exception, match="placement.host_memory_gb must be >= 0"):
        host_memory.host_memory(config(limit=-1.0), HF, plan())


def run(*args):
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_plan_and_launch_refuse_a_node_that_does_not_fit():
    args = ["--config", "configs/qwen3_30b_a3b_h100.yaml", "--recovery", "snapshot", "placement.host_memory_gb=300"]
    p = run("plan", *args)
    assert p.returncode == 1
    assert "does not fit: host memory of a trainer node: 308.3 GB" in p.stderr
    assert "placement.host_memory_gb=300" in p.stderr
    assert "recovery copies (snapshot) 124.0, publish buckets 184.3" in p.stderr
    dry = run("launch", "--dry-run", *args)
    assert dry.returncode == 1 and "DOES NOT FIT: host memory" in dry.stdout and "--skip-memory-check" in dry.stderr
    assert run("plan", *args[:4]).returncode == 0  # the shipped config's 2048 GB
