"""Run MegatronTrainer in several parallel layouts and write what each rank saw as JSON.

Launched by tests/distributed/test_parallel.py, either as one process
(``--modes single``: the 1-rank reference) or under
``python -m torch.distributed.run --nproc_per_node=2`` (``--modes tp2,pp2,dp2,ep2``).
All modes of one launch share the processes (megarl re-initializes megatron's
parallel state between them), which saves the ~5 s import per launch.

Per mode and rank it writes ``OUT/<mode>.rank<r>.json`` with: log-probs of a
fixed batch, whether the exported HF weights equal the checkpoint
bit-exactly, the metrics of one train step (its loss has an entropy bonus), log-probs after it, and (TP) the
q/k layernorm weights after the step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# mode -> (model, tp, pp, ep, use_distributed_optimizer, sequence_parallel)
MODES = {
    "single_dense": ("dense", 1, 1, 1, False, False),
    "single_moe": ("moe", 1, 1, 1, False, False),
    "tp2": ("dense", 2, 1, 1, False, False),
    "tp2_sp": ("dense", 2, 1, 1, False, True),
    "tp2_moe": ("moe", 2, 1, 1, False, True),  # megatron's MoE needs sequence parallelism with TP
    "pp2": ("dense", 1, 2, 1, False, False),
    "dp2": ("dense", 1, 1, 1, True, False),
    "ep2": ("moe", 1, 1, 2, False, False),
}
#: the same layouts replaying hand-built MoE routes (megarl/trainer/routing_replay.py)
REPLAY = {"single_moe_replay": "single_moe", "ep2_replay": "ep2", "tp2_moe_replay": "tp2_moe"}
#: the loop's rank 0 driving a follower through its control channel, replaying (tests/distributed/run_loop_replay.py)
LOOP = {"ep2_loop_replay": "ep2"}


def hand_routes(batch, layers: int = 2):
    """[B, L-1, layers, 2]: row b, position t, layer l go to experts (t+b+l, t+b+l+1) mod 4; -1 past the row."""
    B, L = batch.tokens.shape
    t = torch.arange(L - 1)[None, :, None] + torch.arange(B)[:, None, None] + torch.arange(layers)[None, None, :]
    routes = torch.stack([t % 4, (t + 1) % 4], dim=-1).to(torch.int16)
    routes[torch.arange(L - 1)[None] >= (batch.seq_lens[:, None] - 1)] = -1
    return routes


def make_batch():
    from megarl.types import TrainBatch

    g = torch.Generator().manual_seed(1234)
    lens = torch.tensor([20, 7, 13, 20, 5, 11])
    B, L = len(lens), int(lens.max())
    # ids 1..15: token 0 is HF's padding_idx, whose zero embedding row makes RMSNorm gradients blow up
    tokens = torch.randint(1, 16, (B, L), generator=g)
    for b in range(B):
        tokens[b, lens[b]:] = 0
    mask = (torch.arange(L - 1)[None] < (lens[:, None] - 1)).float()
    z = torch.zeros(B, L - 1)
    return TrainBatch(tokens=tokens, seq_lens=lens, loss_mask=mask, logp_behav=z, versions=z.long(),
                      advantages=z, traj_ids=[str(i) for i in range(B)])


def nll_loss(logp, mb, normalizer, entropy):
    """Mean NLL minus 0.5 x mean entropy (the entropy bonus's vocab-parallel reductions and their gradient)."""
    nll = -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"]
    ent = (entropy * mb.loss_mask).sum() / normalizer["n_valid_tokens"]
    return nll - 0.5 * ent, {"nll": float(nll.detach()), "entropy": float(ent.detach())}


nll_loss.wants_entropy = True


def run_mode(mode: str, ckpts: dict, out: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megarl.trainer.megatron_trainer import MegatronTrainer

    model, tp, pp, ep, dist_opt, sp = MODES[REPLAY.get(mode) or LOOP.get(mode) or mode]
    trainer = MegatronTrainer(ckpts[model], tp=tp, pp=pp, ep=ep, lr=1e-4, micro_batch_tokens=40,
                              use_distributed_optimizer=dist_opt, seed=0, sequence_parallel=sp)
    assert trainer.config.sequence_parallel == sp, (mode, trainer.config.sequence_parallel)
    batch = make_batch()
    if mode in REPLAY or mode in LOOP:
        batch.routes = hand_routes(batch)
    result = {"mode": mode, "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    if mode in LOOP:
        from run_loop_replay import drive_or_follow

        result.update(drive_or_follow(trainer, batch, nll_loss), version=trainer.version)
        (out / f"{mode}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
        return
    result["logprobs"] = trainer.logprobs(batch).tolist()
    reference = load_file(os.path.join(ckpts[model], "model.safetensors"))
    exported = dict(trainer.export_hf_weights())
    kept = dict(trainer.export_hf_weights(to_host=False))  # what follower ranks take part in: no host copies
    result["export_exact"] = (set(exported) == set(reference) == set(kept)
                              and all(torch.equal(exported[k], reference[k]) for k in reference)
                              and all(torch.equal(kept[k], reference[k]) for k in reference))
    result["metrics"] = trainer.train_step(batch, nll_loss)
    result["logprobs_after"] = trainer.logprobs(batch).tolist()
    result["version"] = trainer.version
    result["qk_norm"] = {n: p.tolist() for n, p in trainer.get_params().items() if "_layernorm" in n
                         and ("q_layernorm" in n or "k_layernorm" in n)}
    # every norm weight (input, pre-MLP, final, q/k): replicated over TP, so equal on both ranks
    result["norms"] = {n: p.tolist() for n, p in trainer.get_params().items() if "norm" in n}
    (out / f"{mode}.rank{dist.get_rank()}.json").write_text(json.dumps(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dense", required=True)
    p.add_argument("--moe", required=True)
    p.add_argument("--modes", required=True, help="comma-separated, from: " + ", ".join([*MODES, *REPLAY, *LOOP]))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        run_mode(mode, {"dense": args.dense, "moe": args.moe}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
