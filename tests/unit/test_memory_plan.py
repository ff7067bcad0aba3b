"""The whole-GPU memory plan (megarl/launch/memory.py) and `megarl plan`'s refusal of layouts that do not fit."""
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import MegaRLConfig
from megarl.launch import memory

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
#: a hand-made table: one dense model of hidden size 64
TABLE = {"how": "by hand", "measured": "today", "models": {"toy": {
    "kind": "dense", "hidden_size": 64, "loss_bytes_per_token_per_vocab": 4.0,
    "none": {"bytes_per_token": 1000.0, "bytes_per_token_squared": 10.0},
    "selective": {"bytes_per_token": 900.0, "bytes_per_token_squared": 0.0},
    "full": {"bytes_per_token": 128.0, "bytes_per_token_squared": 0.0}}}}
#: 4 layers; per layer attention 64*64 + 2*64*32 + 64*64 + 2*16 = 12,320, norms 128, MLP 3*64*100 = 19,200;
#: embeddings 1000*64*2 + 64 = 128,064 -> 128,064 + 4 * 31,648 = 254,656 parameters
HF = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "vocab_size": 1000, "intermediate_size": 100, "max_position_embeddings": 4096, "tie_word_embeddings": False}
PARAMS = 254_656


def config(recompute="none", tokens=1000, dtype="bfloat16", distributed=True):
    cfg = MegaRLConfig()
    cfg.model.dtype = dtype
    cfg.trainer.recompute, cfg.trainer.micro_batch_tokens = recompute, tokens
    cfg.parallel.use_distributed_optimizer = distributed
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 100, 400  # longest row 500
    return cfg


def layout(tp=1, pp=1, dp=4, sp=False):
    return SimpleNamespace(tp=tp, pp=pp, ep=1, dp=dp, expert_dp=dp, sequence_parallel=sp)


def test_trainer_gpu_parts_by_hand():
    m = memory.trainer_memory(config(), HF, layout(), table=TABLE)
    assert m.parts["weights"] == PARAMS * 2
    assert m.parts["gradients"] == PARAMS * 4
    assert m.parts["optimizer"] == PARAMS * 12 / 4  # fp32 main + 2 moments, over dp 4
    assert m.parts["activations"] == 4 * 1000.0 * 1000  # layers x bytes per token x tokens
    assert m.parts["logits"] == 1000 * 1000 * (4 + 6)  # tokens x vocab x (kept + bf16 and fp32 logits)
    assert m.peak == m.parts["weights"] + m.parts["gradients"] + m.parts["optimizer"] + 4e6 + 1e7 + 3e9
    # full recompute: every layer's input, plus one layer rebuilt in the backward
    full = memory.trainer_memory(config("full"), HF, layout(), table=TABLE)
    assert full.parts["activations"] == 4 * 128.0 * 1000 + 1000.0 * 1000
    # tp 2 with sequence parallelism splits activations and logits; pp 2 keeps 2 layers x 2 micro-batches
    split = memory.trainer_memory(config(), HF, layout(tp=2, pp=2, dp=1, sp=True), table=TABLE)
    assert split.parts["activations"] == 2 * 2 * 1000.0 * 1000 / 2
    assert split.parts["logits"] == 1000 * 500 * 10
    assert split.parts["weights"] == PARAMS / 4 * 2
    # a micro-batch holds at least the longest row (100 + 400 tokens); fp32 without distributed optimizer
    small = memory.trainer_memory(config(tokens=10, dtype="float32", distributed=False), HF, layout(), table=TABLE)
    assert small.parts["activations"] == 4 * 1000.0 * 500
    assert small.parts["optimizer"] == PARAMS * 8
    assert small.parts["weights"] == PARAMS * 4


def test_local_spec_adds_the_score_matrices():
    cfg = config()
    cfg.model.allow_local_spec = True
    m = memory.trainer_memory(cfg, HF, layout(), table=TABLE)
    assert m.parts["activations"] == 4 * 1000.0 * 1000 + 4 * 10.0 * 1000 * 500  # layers x q x tokens x row


def plan(*args):
    return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("config_file", ["configs/qwen3_4b_h100.yaml", "configs/qwen3_30b_a3b_h100.yaml"])
def test_shipped_gpu_configs_fit(config_file):
    p = plan("--config", config_file)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if "trainer GPU: peak" in x)
    peak = float(re.search(r"peak ([\d.]+) GB", line).group(1))
    assert 10 < peak <= 80, line
    for part in ("weights", "gradients", "optimizer", "activations", "logits"):
        assert f"{part} " in line
    assert "engine GPU: peak" in p.stdout


def test_30b_without_recompute_at_64k_tokens_is_refused():
    p = plan("--config", "configs/qwen3_30b_a3b_h100.yaml", "trainer.recompute=none",
             "trainer.micro_batch_tokens=65536")
    assert p.returncode == 1
    assert "does not fit: a trainer GPU needs" in p.stderr
    assert "trainer.recompute=full" in p.stderr or "trainer.micro_batch_tokens=" in p.stderr


def test_dedicated_scorer_is_weights_only():
    p = plan("--config", "configs/qwen3_30b_a3b_h100.yaml", "--recovery", "dedicated")
    line = next(x for x in p.stdout.splitlines() if "dedicated scorer GPU: peak" in x)
    parts = re.search(r"\((.*?)\)", line).group(1)
    assert parts.startswith("weights 61.1,") and "gradients" not in parts and "optimizer" not in parts
    # 61 GB of weights and a 9k-token row's logits (one layer's activations are gone by then) fit 80 GB
    assert p.returncode == 0, p.stderr


def test_outside_layers_and_the_entropy_path_by_hand():
    table = {**TABLE, "models": {"toy": {**TABLE["models"]["toy"], "outside_layers_bytes_per_token": 300.0,
                                         "entropy_bytes_per_token_per_vocab": 8.0}}}
    m = memory.trainer_memory(config(), HF, layout(), table=table)
    assert m.parts["activations"] == 4 * 1000.0 * 1000 + 300.0 * 1000  # the layers, then once outside them
    assert m.parts["logits"] == 1000 * 1000 * (4 + 6)  # no entropy bonus: as before
    cfg = config()
    cfg.loss.entropy_coef = 0.001
    on = memory.trainer_memory(cfg, HF, layout(), table=table)
    # kept by the entropy path (8) and alive while it runs (4), per token and vocabulary entry
    assert on.parts["logits"] == 1000 * 1000 * (4 + 6 + 8 + memory.ENTROPY_TRANSIENT)
    cfg.loss.entropy_coef, cfg.loss.entropy_target = 0.0, 0.5  # an entropy target runs the same path
    assert memory.trainer_memory(cfg, HF, layout(), table=table).parts["logits"] == on.parts["logits"]
    assert memory.trainer_memory(cfg, HF, layout(), table=table, entropy=False).parts["logits"] == 1000 * 1000 * 10


def test_the_30b_plan_with_the_entropy_bonus_is_refused_naming_the_key():
    # on 70 GB GPUs: the shipped layout's 64 GB fits, with the entropy bonus's logits it does not
    base = plan("--config", "configs/qwen3_30b_a3b_h100.yaml", "placement.gpu_memory_gb=70")
    on = plan("--config", "configs/qwen3_30b_a3b_h100.yaml", "loss.entropy_coef=0.001", "placement.gpu_memory_gb=70")
    grown = _part(on.stdout, "logits") - _part(base.stdout, "logits")
    # 9216 tokens x 151,936 / 2 (TP2) vocabulary entries x (8 kept + 4 transient) bytes
    assert grown == pytest.approx(9216 * 151936 / 2 * 12 / GB, abs=0.06)
    assert base.returncode == 0 and on.returncode == 1
    assert "loss.entropy_coef=0 with loss.entropy_target=null" in on.stderr


def _part(out: str, name: str) -> float:
    return float(re.search(rf"trainer GPU: peak [\d.]+ GB \(.*?{name} ([\d.]+)", out).group(1))


def test_the_readme_quotes_the_plans_peaks():
    """README's "Qwen3-4B trainer GPU peak N GB ... Qwen3-30B-A3B M GB" are the plan's, rounded."""
    text = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(r"Qwen3-4B trainer GPU peak (\d+) GB.*?Qwen3-30B-A3B (\d+) GB", text)
    assert quoted, "README no longer quotes the two trainer peaks"
    for config_file, gb in zip(("configs/qwen3_4b_h100.yaml", "configs/qwen3_30b_a3b_h100.yaml"), quoted.groups()):
        peak = float(re.search(r"trainer GPU: peak ([\d.]+) GB", plan("--config", config_file).stdout).group(1))
        assert round(peak) == int(gb), (config_file, peak, gb)


def test_the_recovery_strategys_gpu_bytes_by_hand():
    # a strategy that swaps parameters in holds the largest tensor in fp32 for a moment: the embedding,
    # 1000 x 64 x 4 B (the MLP's 3 x 64 x 100 is smaller); ewma with phi_on_gpu adds its bf16 phi, which the
    # forward points at (no saved copy of the current parameters): PARAMS x 2 B
    cfg = config()
    assert memory.trainer_memory(cfg, HF, layout(), table=TABLE).parts["recovery"] == 0.0  # behav: nothing
    cfg.recovery.name = "snapshot"
    assert memory.trainer_memory(cfg, HF, layout(), table=TABLE).parts["recovery"] == 256_000
    cfg.recovery.name = "ewma"
    cfg.recovery.options["ewma"] = {"phi_on_gpu": True}
    on = memory.trainer_memory(cfg, HF, layout(), table=TABLE)
    assert on.parts["recovery"] == 256_000 + PARAMS * 2
    # an fp32 phi and, while it scores, its bf16 cast for the forward: PARAMS x (4 + 2)
    cfg.recovery.options["ewma"] = {"phi_on_gpu": True, "phi_dtype": "float32"}
    assert memory.trainer_memory(cfg, HF, layout(), table=TABLE).parts["recovery"] == 256_000 + PARAMS * 6
    # a GPU it no longer fits: refused, naming the key that moves phi back to the host (the fixes are priced
    # with the shipped activation table)
    peak = memory.trainer_memory(cfg, HF, layout()).peak
    fixes = memory._trainer_fixes(cfg, HF, layout(), peak - 1)
    assert any(f.startswith("recovery.ewma.phi_on_gpu=false (phi in host memory") for f in fixes)


def test_the_30b_layouts_where_ewma_keeps_phi_on_the_gpu_are_the_readmes():
    # phi on the GPU is one bf16 shard (the forward points at it): ewma then adds one forward and no PCIe; the
    # README names where that fits at 30B, and the plan must say the same
    text = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(r"On the shipped 30B layout \(TP2 x EP8\) there is \(([\d.]+) GB of 80\); at TP1 .*?"
                       r"there is none \(([\d.]+) GB of 80\)", text)
    assert quoted, "README no longer says where ewma's phi fits on the 30B trainer GPUs"
    base = ("--config", "configs/qwen3_30b_a3b_h100.yaml", "--recovery", "ewma", "--cost",
            "recovery.ewma.phi_on_gpu=true")
    runs = [plan(*base), plan(*base, "parallel.tp=1", "parallel.sequence_parallel=false")]
    assert [r.returncode for r in runs] == [0, 1]
    assert "a trainer GPU needs" in runs[1].stderr and "parallel.tp" in runs[1].stderr
    for run, gb in zip(runs, quoted.groups()):
        peak = float(re.search(r"trainer GPU: peak ([\d.]+) GB", run.stdout).group(1))
        assert peak == float(gb)
        row = re.search(r"^\| ewma \|.*$", run.stdout, re.M).group(0).split("|")
        assert float(row[3]) == 0.0 and row[8].strip() == "0.00 (0.00)"  # no host copy, nothing over PCIe
