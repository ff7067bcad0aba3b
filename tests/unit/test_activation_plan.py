"""The memory plan's activation term against what the real trainer keeps: measured, not restated.

The plan (megarl/launch/memory.py) reads per-layer bytes per token from a table the activation probe
measures on 1- and 2-layer slices (megarl/launch/activation_probe.py). Here the probe measures the tiny
4-layer model's table, and the bytes MegatronTrainer's own training forward keeps for its backward
(every storage autograd saves before the backward starts, parameters excluded) are counted on one
micro-batch under each ``trainer.recompute``: the plan must be within 20% of them. Full recompute must keep
far fewer bytes than none: a recompute that did nothing would keep as many (the negative control).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
B, L = 4, 96  # one micro-batch of 4 rows of 96 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_m.yaml", tmp_path_factory.mktemp("m") / "m", seed=0)
    return ckpt, json.loads((ckpt / "config.json").read_text())


def trainer_saved_bytes(ckpt, recompute: str, entropy: bool = False) -> int:
    """Bytes MegatronTrainer's training forward keeps for the backward of one micro-batch (module doc)."""
    from megarl.trainer.megatron_trainer import MegatronTrainer
    from megarl.types import TrainBatch

    trainer = MegatronTrainer(str(ckpt), dtype="bfloat16", recompute=recompute, micro_batch_tokens=B * L,
                              allow_local_spec=True)
    tokens = torch.randint(1, int(trainer.hf_config["vocab_size"]), (B, L), generator=torch.Generator().manual_seed(0))
    z = torch.zeros(B, L - 1)
    batch = TrainBatch(tokens=tokens, seq_lens=torch.full((B,), L), loss_mask=z + 1, logp_behav=z,
                       versions=z.long(), advantages=z, traj_ids=[str(i) for i in range(B)])
    params = {p.untyped_storage().data_ptr() for p in trainer._module().parameters()}
    seen: dict[int, int] = {}
    backward = []

    def pack(t: torch.Tensor):
        if not backward:  # a full recompute's rerun in the backward saves again: one layer at a time, not counted
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
        return t

    def loss_func(mb, ce):
        if entropy:  # [b, n, 2]: the cross entropy and the entropy, both in the loss as the bonus puts them
            ce = ce[..., 0] - 0.01 * ce[..., 1]
        loss = (ce.float() * mb.batch.loss_mask).sum() / float(mb.batch.loss_mask.sum())
        loss.register_hook(lambda g: backward.append(True))  # the first gradient computed: the backward began
        return loss, torch.tensor(1, dtype=torch.int), {}

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer._run(batch, loss_func, forward_only=False, with_entropy=entropy)
    assert backward, "the backward ran"
    return sum(seen.values())


def planned_bytes(hf: dict, table: dict, recompute: str) -> float:
    """The plan's activation bytes of that micro-batch kept through the forward (its logits' saved part
    included, its transient logits and full recompute's one rebuilt layer left out)."""
    from megarl.builder import load_run_config
    from megarl.launch import memory
    from megarl.launch.placement import TrainerPlan

    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml",
                          ["model.dtype=bfloat16", "model.allow_local_spec=true",
                           f"trainer.micro_batch_tokens={B * (L - 1)}", f"data.max_prompt_len={L // 2}",
                           f"rollout.max_new_tokens={L // 2 - 1}"])
    t = TrainerPlan(hosts=("h",), ranks_per_node=1, world_size=1, tp=1, pp=1, ep=1, dp=1, expert_dp=1,
                    sequence_parallel=False, gpu_ids=())
    parts = memory.trainer_memory(cfg, hf, t, recompute=recompute, table=table).parts
    tokens = B * (L - 1)
    rebuilt = (table["models"]["m"]["none"]["bytes_per_token"] * tokens) if recompute == "full" else 0.0
    saved_loss = tokens * int(hf["vocab_size"]) * table["models"]["m"]["loss_bytes_per_token_per_vocab"]
    return parts["activations"] - rebuilt + saved_loss


def test_the_plan_is_within_20_percent_of_what_the_trainer_keeps(model):
    from megarl.launch.activation_probe import measure
    from megarl.trainer.parallel import init_parallel

    ckpt, hf = model
    init_parallel(tp=1, pp=1, ep=1, seed=0)  # the probe builds bare slices; the trainer does this itself
    table = {"models": {"m": {"kind": "dense", "hidden_size": int(hf["hidden_size"]), **measure(hf, seqs=(96, 192))}}}
    measured = {mode: trainer_saved_bytes(ckpt, mode) for mode in ("none", "selective", "full")}
    for mode, got in measured.items():
        plan = planned_bytes(hf, table, mode)
        assert abs(plan / got - 1) <= 0.20, f"{mode}: plan {plan:.3g} B, the trainer kept {got:.3g} B"
    # the negative control: full recompute keeps each layer's input, a small part of what none keeps
    assert measured["full"] < 0.1 * measured["none"], measured


def test_the_entropy_bonus_logits_term_is_what_its_path_keeps(tmp_path):
    """loss.entropy_coef > 0 runs the entropy path on the full-vocabulary logits: the plan's extra logits bytes
    (the probe's measure of that path, per token and vocabulary entry) against the extra bytes the trainer
    keeps with the entropy on, on a 4096-entry vocabulary so that the logits dominate."""
    import yaml

    from megarl.launch import memory
    from megarl.launch.activation_probe import entropy_bytes_per_vocab
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer.parallel import init_parallel

    spec = yaml.safe_load((REPO / "configs/models/tiny_qwen3_m.yaml").read_text())
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(dict(spec, vocab_size=4096, num_hidden_layers=1)))
    ckpt = write_tiny_checkpoint(tmp_path / "wide.yaml", tmp_path / "wide", seed=0)
    hf = json.loads((ckpt / "config.json").read_text())
    init_parallel(tp=1, pp=1, ep=1, seed=0)
    per_entry = entropy_bytes_per_vocab(hf, torch.randint(1, 512, (1, 129), generator=torch.Generator()), 512, 2048)
    extra = trainer_saved_bytes(ckpt, "none", entropy=True) - trainer_saved_bytes(ckpt, "none")
    planned = B * (L - 1) * int(hf["vocab_size"]) * per_entry
    assert abs(planned / extra - 1) <= 0.20, (planned, extra, per_entry)
    on = SimpleNamespace(loss=SimpleNamespace(entropy_coef=0.001, entropy_target=None))
    off = SimpleNamespace(loss=SimpleNamespace(entropy_coef=0.0, entropy_target=None))
    assert memory.entropy_bonus(on) and not memory.entropy_bonus(off)
