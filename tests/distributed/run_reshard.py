"""Reshardable trainer and strategy state across layouts (launched by test_reshard.py).

``--phase save`` runs under ``torchrun --nproc_per_node=2``; per mode (``tp2``: the dense model at TP2
with megatron's plain optimizer, ``dp2``: DP2 with the distributed optimizer, ``ep2``: the tiny MoE at
EP2) it trains 2 steps on a fixed batch, ``save_reshardable``s to ``OUT/<mode>/ckpt`` and writes a
strategy state holding two copies of the weights (``versions[2]``: the weights; ``phi``: ``0.5 w + 1``)
to ``OUT/<mode>/strategy`` (megarl/trainer/param_state.py), writes the full (gathered, HF-named)
weights, then trains steps 3 and 4 uninterrupted: ``OUT/<mode>/ref.json`` has their losses and the
save time, ``weights_after{2,3}.pt`` the weights. Each mode also resumes its checkpoint in its own
layout (bitwise); ``tp2`` also writes the per-rank format (megarl/trainer/state.py) to
``OUT/tp2/per_rank``, which ``load_reshardable`` takes in the same layout through that format's loader.

``--phase load`` is one plain process (TP1, DP1, EP1). Per mode it loads the checkpoint and writes
``OUT/<mode>/resumed.json``: whether the weights equal the saved ones exactly, whether the strategy's
copies are the loaded weights (and ``0.5 w + 1`` of them), the largest weight difference after step
3, the losses of steps 3 and 4 and the load time. ``<mode>/dropped.json`` is the same after replacing
the loaded optimizer by a fresh one (the negative control), and ``tp2/per_rank_error.json`` what
loading the per-rank checkpoint at TP1 raised.

``--phase load_pp2`` runs under torchrun with 2 ranks and loads the ``tp2`` checkpoint at PP2
(``OUT/tp2/resumed_pp2.json``, the same fields).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# mode -> (model, tp, ep at save, use_distributed_optimizer)
MODES = {"tp2": ("dense", 2, 1, False), "dp2": ("dense", 1, 1, True), "ep2": ("moe", 1, 2, False)}


def nll(logp, mb, normalizer):
    return -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"], {}


def build(checkpoint: str, tp: int = 1, dist_opt: bool = False, ep: int = 1, pp: int = 1):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(checkpoint, tp=tp, pp=pp, ep=ep, lr=1e-2, micro_batch_tokens=40, seed=0,
                           use_distributed_optimizer=dist_opt)


def full_weights(trainer) -> dict:
    """The full HF-named weights (a collective: every rank consumes the stream)."""
    return {k: v.clone() for k, v in trainer.export_hf_weights()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def strategy_copies(trainer) -> dict:
    """A strategy state with two copies of the weights, one of them not the weights themselves."""
    w = trainer.get_params()
    return {"n": 7, "versions": {2: w}, "phi": {k: 0.5 * t + 1 for k, t in w.items()}}


def copies_check(trainer, loaded: dict) -> dict:
    want = strategy_copies(trainer)
    return {"copies_exact": loaded["n"] == 7 and sorted(loaded["versions"]) == [2]
            and all(torch.equal(loaded["versions"][2][k], t) for k, t in want["versions"][2].items())
            and all(torch.equal(loaded["phi"][k], t) for k, t in want["phi"].items())}


def save_phase(ckpts: dict, out: Path) -> None:
    import torch.distributed as dist
    from run_parallel import make_batch

    from megarl.trainer.dist_state import load_reshardable, save_reshardable
    from megarl.trainer.param_state import save_strategy_state
    from megarl.trainer.state import save_trainer_state

    batch = make_batch()
    for mode, (model, tp, ep, dist_opt) in MODES.items():
        d = out / mode
        a = build(ckpts[model], tp, dist_opt, ep)
        a.train_step(batch, nll)
        a.train_step(batch, nll)
        saved = save_reshardable(a, str(d / "ckpt"))
        save_strategy_state(a, strategy_copies(a), str(d / "strategy"))
        w2 = full_weights(a)
        if mode == "tp2":
            save_trainer_state(a, str(d / "per_rank"))
        loss3 = a.train_step(batch, nll)["loss"]
        w3 = full_weights(a)
        loss4 = a.train_step(batch, nll)["loss"]
        ref = {"loss3": loss3, "loss4": loss4, "save_s": saved["seconds"], "version": a.version}
        for fmt in ("ckpt", "per_rank") if mode == "tp2" else ("ckpt",):  # the same layout: resumes bitwise
            b = build(ckpts[model], tp, dist_opt, ep)
            info = load_reshardable(b, str(d / fmt))
            ref[f"same_layout_{fmt}"] = {"format": info["format"], "loss3": b.train_step(batch, nll)["loss"],
                                         "w3_diff": max_diff(full_weights(b), w3)}
        if dist.get_rank() == 0:
            torch.save(w2, d / "weights_after2.pt")
            torch.save(w3, d / "weights_after3.pt")
            (d / "ref.json").write_text(json.dumps(ref))


def resume(checkpoint: str, d: Path, dist_opt: bool, batch, drop_optimizer: bool, pp: int = 1) -> dict:
    from megarl.trainer.dist_state import load_reshardable
    from megarl.trainer.param_state import load_strategy_state

    b = build(checkpoint, 1, dist_opt, pp=pp)
    info = load_reshardable(b, str(d / "ckpt"))
    w = full_weights(b)
    w2 = torch.load(d / "weights_after2.pt")
    res = {"format": info["format"], "load_s": info["seconds"], "version": b.version,
           "weights_exact": set(w) == set(w2) and all(torch.equal(w[k], w2[k]) for k in w2),
           **copies_check(b, load_strategy_state(b, str(d / "strategy")))}
    if drop_optimizer:  # negative control: the loaded Adam moments and step count are lost
        b.optimizer = None
        b._ensure_optimizer()
    res["loss3"] = b.train_step(batch, nll)["loss"]
    res["w3_diff"] = max_diff(full_weights(b), torch.load(d / "weights_after3.pt"))
    res["loss4"] = b.train_step(batch, nll)["loss"]
    return res


def load_phase(ckpts: dict, out: Path) -> None:
    from run_parallel import make_batch

    from megarl.errors import CheckpointError
    from megarl.trainer.dist_state import load_reshardable

    batch = make_batch()
    for mode, (model, _, _, dist_opt) in MODES.items():
        d = out / mode
        (d / "resumed.json").write_text(json.dumps(resume(ckpts[model], d, dist_opt, batch, drop_optimizer=False)))
        (d / "dropped.json").write_text(json.dumps(resume(ckpts[model], d, dist_opt, batch, drop_optimizer=True)))
    try:
        load_reshardable(build(ckpts["dense"], 1, False), str(out / "tp2" / "per_rank"))
        err = None
    except CheckpointError as e:
        err = str(e)
    (out / "tp2" / "per_rank_error.json").write_text(json.dumps({"error": err}))


def load_pp2_phase(ckpts: dict, out: Path) -> None:
    import torch.distributed as dist
    from run_parallel import make_batch

    res = resume(ckpts["dense"], out / "tp2", False, make_batch(), drop_optimizer=False, pp=2)
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, res["copies_exact"])
    if dist.get_rank() == 0:
        (out / "tp2" / "resumed_pp2.json").write_text(json.dumps({**res, "copies_exact": all(copies)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=("save", "load", "load_pp2"), required=True)
    p.add_argument("--checkpoint", required=True, help="the dense model")
    p.add_argument("--moe-checkpoint", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    for mode in MODES:
        (out / mode).mkdir(parents=True, exist_ok=True)
    phase = {"save": save_phase, "load": load_phase, "load_pp2": load_pp2_phase}[args.phase]
    phase({"dense": args.checkpoint, "moe": args.moe_checkpoint}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
