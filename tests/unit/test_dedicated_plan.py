"""The dedicated scorer's own micro-batch budget (``recovery.dedicated.micro_batch_tokens``): the memory plan sizes
the scorer's GPU with it (megarl/launch/memory.py ``dedicated_memory``) and the scorer is built with it
(recovery/_dedicated_scorer.py), so the runtime packs its forwards as the plan says."""
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from recovery_scorer import LoopState, tiny_checkpoint
from test_dedicated_batch_invariant import FakeContext, child_args

import recovery._dedicated_scorer as scorer_side
import recovery.dedicated as strategy_side
from megarl.builder import load_run_config
from megarl.config import MegaRLConfig
from megarl.launch import memory
from recovery.dedicated import Dedicated, DedicatedConfig

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9
#: a hand-made table: one dense model of hidden size 64 (one layer keeps 1000 B per token, 10 B per token^2)
TABLE = {"how": "by hand", "measured": "today", "models": {"toy": {
    "kind": "dense", "hidden_size": 64, "loss_bytes_per_token_per_vocab": 4.0,
    "none": {"bytes_per_token": 1000.0, "bytes_per_token_squared": 10.0},
    "selective": {"bytes_per_token": 900.0, "bytes_per_token_squared": 0.0},
    "full": {"bytes_per_token": 128.0, "bytes_per_token_squared": 0.0}}}}
#: 254,656 parameters (tests/unit/test_memory_plan.py counts them), vocabulary 1000
HF = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "vocab_size": 1000, "intermediate_size": 100, "max_position_embeddings": 4096, "tie_word_embeddings": False}
PARAMS = 254_656
#: Qwen3-30B-A3B: 30,532,122,624 parameters (configs/models/qwen3_30b_a3b.yaml), vocabulary 151,936
QWEN30B_PARAMS, QWEN30B_VOCAB = 30_532_122_624, 151_936


def config(scorer_tokens: int | None = None) -> MegaRLConfig:
    cfg = MegaRLConfig()
    cfg.model.dtype = "bfloat16"
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = 100, 400  # longest row 500
    if scorer_tokens is not None:
        cfg.recovery.options["dedicated"] = DedicatedConfig(micro_batch_tokens=scorer_tokens)
    return cfg


def test_the_scorers_logits_are_of_its_own_micro_batch():
    m = memory.dedicated_memory(config(2048), HF, TABLE)
    # 2048 tokens x 1000 vocabulary entries x (bf16 logits 2 + their fp32 copy 4 + the fp32 quotient by T 4) B
    assert m.parts["logits"] == 2048 * 1000 * (2 + 4 + 4) == 20_480_000
    assert m.parts["activations"] == 2048 * 1000.0  # one layer's, over the same tokens
    assert m.parts["weights"] == PARAMS * 2
    # a forward without a graph: the layer's tensors are gone before the logits exist; the larger one counts
    assert m.peak == PARAMS * 2 + 20_480_000 + 3e9
    assert "activations 0.0 or logits 0.0" in m.line()
    # the trainer's budget does not enter; below one longest row (500 tokens) a row still gets its micro-batch
    cfg = config(100)
    cfg.trainer.micro_batch_tokens = 65536
    assert memory.dedicated_memory(cfg, HF, TABLE).parts["logits"] == 500 * 1000 * 10
    # a config built without the strategies' sections plans with the option's default
    assert memory.dedicated_memory(config(), HF, TABLE).parts["logits"] == 4096 * 1000 * 10
    assert DedicatedConfig().micro_batch_tokens == memory.SCORER_MICRO_BATCH_TOKENS == 4096


def test_the_local_spec_adds_one_layers_score_matrices():
    cfg = config(2048)
    cfg.model.allow_local_spec = True
    m = memory.dedicated_memory(cfg, HF, TABLE)
    assert m.parts["activations"] == 2048 * 1000.0 + 10.0 * 2048 * 500  # tokens x row for [heads, s, s]
    assert m.peak == PARAMS * 2 + 20_480_000 + 3e9  # 12.3 MB of activations, still under the logits


def test_the_option_is_a_config_key():
    cfg = load_run_config(None, ["recovery.name=dedicated", "recovery.dedicated.micro_batch_tokens=2048"])
    assert memory.scorer_micro_batch_tokens(cfg) == 2048
    cfg.recovery.options["dedicated"].micro_batch_tokens = 0
    with pytest.raises(Exception, match="recovery.dedicated.micro_batch_tokens must be >= 1"):
        memory.scorer_micro_batch_tokens(cfg)


def plan(*args):
    return subprocess.run([sys.executable, "-m", "megarl.cli", "plan", "--config", "configs/qwen3_30b_a3b_h100.yaml",
                           "--recovery", "dedicated", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def scorer_line(out: str) -> str:
    return next(x for x in out.splitlines() if "dedicated scorer GPU: peak" in x)


def test_the_30b_scorer_fits_80_gb_with_the_default():
    p = plan("--cost")
    assert p.returncode == 0, p.stderr
    line = scorer_line(p.stdout)
    # one longest row (1024 + 8192 tokens) per micro-batch, above the 4096-token budget
    logits = 9216 * QWEN30B_VOCAB * 10  # 14.0 GB
    weights = QWEN30B_PARAMS * 2  # 61.1 GB of bf16
    peak = weights + logits + 3e9  # 78.1 GB: one layer's 2.0 GB of activations is gone when the logits exist
    assert f"peak {peak / GB:.1f} GB (weights {weights / GB:.1f}, activations 2.0 or logits {logits / GB:.1f}" in line
    assert "9216 tokens per micro-batch" in line
    assert f"1 GPU, peak {peak / GB:.1f} GB" in p.stdout  # the cost table's scorer column


def test_a_large_budget_is_refused_naming_the_key():
    p = plan("recovery.dedicated.micro_batch_tokens=16384")
    assert p.returncode == 1
    big = QWEN30B_PARAMS * 2 + 16384 * QWEN30B_VOCAB * 10 + 3e9  # 89.0 GB
    assert f"peak {big / GB:.1f} GB" in scorer_line(p.stdout)
    # the largest multiple of 1024 that fits: 10240 tokens of logits, 15.6 GB
    fits = QWEN30B_PARAMS * 2 + 10240 * QWEN30B_VOCAB * 10 + 3e9
    assert fits <= 80 * GB < QWEN30B_PARAMS * 2 + 11264 * QWEN30B_VOCAB * 10 + 3e9
    assert f"the dedicated scorer needs {big / GB:.1f} GB > 80 GB" in p.stderr
    assert f"set recovery.dedicated.micro_batch_tokens=10240 ({fits / GB:.1f} GB)" in p.stderr


def test_a_gpu_too_small_for_one_row_says_a_multi_gpu_scorer_is_not_built():
    # 78.1 GB at one longest row per micro-batch: no budget makes it fit 76 GB (the trainer's 74.9 GB does)
    p = plan("placement.gpu_memory_gb=76")
    assert p.returncode == 1
    assert "a trainer GPU needs" not in p.stderr
    assert re.search(r"even one longest row per micro-batch \(9216 tokens.*\) needs 78\.1 GB", p.stderr)
    assert "a dedicated scorer across several GPUs is not built" in p.stderr
    assert "recovery.name" in p.stderr and "placement.gpu_memory_gb" in p.stderr


# -- the runtime scorer gets the same budget ---------------------------------------------------------------
class RecordingTrainer:
    def __init__(self, checkpoint_dir, **kwargs):
        self.kwargs = kwargs


def test_build_scorer_hands_the_budget_to_the_model(monkeypatch):
    monkeypatch.setattr(scorer_side, "MegatronTrainer", RecordingTrainer)
    assert scorer_side._build_scorer("", "/ckpt", micro_batch_tokens=2048).kwargs["micro_batch_tokens"] == 2048
    assert scorer_side._build_scorer("", "/ckpt").kwargs["micro_batch_tokens"] == 4096


def test_the_spawned_scorer_gets_the_configured_budget(monkeypatch, tmp_path):
    fake = FakeContext()
    monkeypatch.setattr(strategy_side.mp, "get_context", lambda kind: fake)
    monkeypatch.delenv("MEGARL_DEDICATED_ADDR", raising=False)
    trainer = SimpleNamespace(dtype="bfloat16", temperature=1.0, allow_local_spec=False, batch_invariant=False,
                              micro_batch_tokens=9216)  # the trainer's budget is not the scorer's
    strat = Dedicated(DedicatedConfig(micro_batch_tokens=2048),
                      LoopState().context(trainer, run_dir=tmp_path, checkpoint_dir="/ckpt"))
    strat._start()
    strat._link._closing.set()  # ends the link's reader thread; there is no child to hear from
    ((target, args),) = fake.started
    assert target is scorer_side._child_main and child_args(args)["micro_batch_tokens"] == 2048


def test_the_scorer_role_gets_the_configured_budget(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    built = []
    conn = SimpleNamespace(send=print)
    monkeypatch.setattr(scorer_side, "_own_world", lambda env: None)  # keep this process's environment
    monkeypatch.setattr(scorer_side, "_build_scorer", lambda *a: built.append(a) or "scorer")
    monkeypatch.setattr(scorer_side, "_serve", lambda scorer, recv, send: None)
    monkeypatch.setattr(scorer_side.listening, "listen", lambda port, host: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(scorer_side.listening, "accept_in_background",
                        lambda listener, key, warn, *a, **kw: SimpleNamespace(get=lambda: conn))
    monkeypatch.setattr(scorer_side.listening, "reader", lambda c, *a: None)
    monkeypatch.setattr(scorer_side.link, "hang_up", lambda c: None)
    run_cfg = SimpleNamespace(
        recovery=SimpleNamespace(name="dedicated", options={"dedicated": DedicatedConfig(micro_batch_tokens=2048)}),
        model=SimpleNamespace(checkpoint=str(tmp_path), dtype="bfloat16", allow_local_spec=False),
        rollout=SimpleNamespace(temperature=1.0, batch_invariant=False))
    scorer_side.serve_role(run_cfg, 1, b"k")
    assert [a[-1] for a in built] == [2048]  # _build_scorer's micro_batch_tokens


def test_the_built_scorer_packs_its_forwards_under_the_budget(monkeypatch, tmp_path):
    """The real forward-only MegatronTrainer (tiny model, CPU): its micro-batches are planned with the scorer's
    budget, a row longer than it is scored alone, and the log-probs are those of one micro-batch."""
    from test_parity_hf import make_batch

    from megarl.trainer import megatron_trainer

    ckpt = str(tiny_checkpoint(tmp_path / "ckpt"))
    planned = []

    def recording(batch, dp_rank, dp, budget, **kw):
        mbs = real_plan(batch, dp_rank, dp, budget, **kw)
        planned.append((budget, [len(mb.rows) for mb in mbs]))
        return mbs

    real_plan = megatron_trainer.plan_microbatches
    monkeypatch.setattr(megatron_trainer, "plan_microbatches", recording)
    batch = make_batch(1)  # rows of 24, 9, 17, 3, 24 and 12 tokens
    small = scorer_side._build_scorer("", ckpt, micro_batch_tokens=20)
    logp = small.logprobs(batch)
    (budget, rows), = planned
    assert small.micro_batch_tokens == 20 and budget == 20
    assert sum(rows) == 6 and len(rows) > 2  # the 24-token rows alone, the rest within 20 tokens a rectangle
    planned.clear()
    whole = scorer_side._build_scorer("", ckpt).logprobs(batch)
    assert planned == [(4096, [6])]
    torch.testing.assert_close(logp, whole)
