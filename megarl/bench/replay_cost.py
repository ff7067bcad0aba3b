"""What routing replay costs: the bytes of routes per token, and the share of a train step the replay adds.

``megarl bench`` on a config with ``rollout.routing_replay=true`` runs :func:`measure` once, in a process of
its own (``python -m megarl.bench.replay_cost SPEC``, so its trainer is not the parent's): one trainer (a
single rank) built from the run config, a batch of ``trainer.batch_size`` rows of random tokens as long as
``data.max_prompt_len + rollout.max_new_tokens`` allows, and train steps on it alternately without routes
and replaying the trainer's own routes of that batch (what an engine that routes as the trainer would
send: same experts, so the same load per expert). The first step of each kind is warm-up. The ratio of
the mean step times is the replay's share of a train step (the anchor's forwards replay too, at most the
same share of theirs); the engine's side (recording routes) is not in it. Each timed pair also gives a
ratio, and ``replay_step_interval`` is their geometric mean with a 90% t interval on the log over the
pairs (megarl/bench/interleave.py; None bounds with one pair).

Routes are stored as uint8 (below 255 experts, else int16): ``MoE layers x top-k x 1 (or 2)`` bytes per
token (``route_bytes_per_token``). The engines' side (capture time, prefix-cache reuse given up) is
megarl/bench/replay_engine_cost.py's.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Any

from megarl.bench.interleave import ratio_interval, ratio_text
from megarl.errors import ConfigError, MegarlError

#: timed steps of each kind after the warm-up pair
DEFAULT_REPEATS = 3


def _nll(logp, mb, normalizer):
    loss = -(logp * mb.loss_mask).sum() / normalizer["n_valid_tokens"]
    return loss, {}


def random_batch(rows: int, max_len: int, vocab: int, seed: int = 0):
    """``rows`` rows of random tokens (ids 1..vocab-1), lengths between half of ``max_len`` and ``max_len``."""
    import torch

    from megarl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(2, max_len // 2), max_len + 1, (rows,), generator=g)
    L = int(lens.max())
    tokens = torch.randint(1, vocab, (rows, L), generator=g)
    tokens[torch.arange(L)[None] >= lens[:, None]] = 0
    mask = (torch.arange(L - 1)[None] < (lens[:, None] - 1)).float()
    z = torch.zeros(rows, L - 1)
    return TrainBatch(tokens=tokens, seq_lens=lens, loss_mask=mask, logp_behav=z, versions=z.long(), advantages=z,
                      traj_ids=[str(i) for i in range(rows)])


def measure(cfg, repeats: int = DEFAULT_REPEATS) -> dict[str, Any]:
    """Build the run's trainer and time train steps without and with replay (module doc)."""
    from megarl.builder import build_trainer
    from megarl.preflight import ensure_checkpoint
    from megarl.trainer.routing_replay import live_routes

    if cfg.placement.trainer_ranks > 1 or max(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep) > 1:
        raise ConfigError("the routing replay cost is measured on one trainer rank: run the bench with "
                          "placement.trainer_ranks=1 and parallel.tp=pp=ep=1")
    trainer = build_trainer(cfg, ensure_checkpoint(cfg))
    if not trainer.n_moe_layers:
        raise ConfigError(f"{cfg.model.checkpoint} is dense: routing replay has nothing to cost")
    hf = trainer.hf_config
    max_len = min(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, int(hf["max_position_embeddings"]))
    live = random_batch(cfg.trainer.batch_size, max_len, int(hf["vocab_size"]), seed=cfg.trainer.seed)
    replayed = dataclasses.replace(live, routes=live_routes(trainer, live))
    times: dict[str, list[float]] = {"live": [], "replay": []}
    for _ in range(repeats + 1):  # alternating, so a slower or faster machine moment hits both kinds
        for kind, batch in (("live", live), ("replay", replayed)):
            t0 = time.perf_counter()
            trainer.train_step(batch, _nll)
            times[kind].append(time.perf_counter() - t0)
    live_s = sum(times["live"][1:]) / repeats
    replay_s = sum(times["replay"][1:]) / repeats
    k = int(replayed.routes.shape[-1])
    n_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    bytes_per_id = 1 if n_experts < 255 else 2  # how trajectories store them (megarl.routes.compact)
    return {"n_moe_layers": trainer.n_moe_layers, "top_k": k,
            "route_bytes_per_token": trainer.n_moe_layers * k * bytes_per_id,
            "rows": live.size, "tokens": int(live.seq_lens.sum()), "repeats": repeats,
            "train_step_s_live": live_s, "train_step_s_replay": replay_s, "replay_step_ratio": replay_s / live_s,
            "replay_step_interval": ratio_interval(times["replay"][1:], times["live"][1:])}


def run_measure(config: str | None, overrides: list[str], repeats: int = DEFAULT_REPEATS) -> dict[str, Any]:
    """:func:`measure` in a fresh Python process; its result."""
    spec = json.dumps({"config": config, "overrides": overrides, "repeats": repeats})
    proc = subprocess.run([sys.executable, "-m", "megarl.bench.replay_cost", spec], capture_output=True, text=True)
    if proc.returncode != 0:
        raise MegarlError(f"measuring the routing replay cost failed (exit code {proc.returncode}):\n"
                          + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary_line(cost: dict[str, Any]) -> str:
    """One line: the bytes per token and what replay adds to a train step."""
    return (f"routing replay: {cost['route_bytes_per_token']} bytes of routes per token ({cost['n_moe_layers']} "
            f"MoE layers x top-{cost['top_k']}); train step {cost['train_step_s_live']:.3f} s live, "
            f"{cost['train_step_s_replay']:.3f} s replaying: x{cost['replay_step_ratio']:.3f} "
            f"({(cost['replay_step_ratio'] - 1) * 100:+.1f}% of the step)" + _pairs(cost.get("replay_step_interval")))


def _pairs(r: dict[str, Any] | None) -> str:
    """The per-pair ratios' geometric mean and 90% t interval, when there are at least two pairs."""
    return "" if r is None or r["low"] is None else f"; per alternated pair x{ratio_text(r)} over {r['n']} pairs"


def render_markdown(cost: dict[str, Any]) -> str:
    """The report's routing replay section: the trainer's side and, where measured, the engines'."""
    from megarl.bench.replay_engine_cost import summary_line as engine_line

    out = (f"\n## Routing replay\n\n{summary_line(cost)}, over {cost['rows']} rows ({cost['tokens']} tokens), "
           f"the mean of {cost['repeats']} steps of each kind after one warm-up step each.\n")
    if "engine_capture_ratio" in cost:
        out += (f"\n{engine_line(cost)} (the mean of {cost['engine_rounds']} rounds after a warm-up round; "
                f"megarl/bench/replay_engine_cost.py says what is given up and where).\n")
    return out


if __name__ == "__main__":
    from megarl.builder import load_run_config

    args = json.loads(sys.argv[1])
    result = measure(load_run_config(args["config"], args["overrides"]), args["repeats"])
    print(json.dumps(result))
