"""Routing replay (R3): the trainer's MoE routers take the experts the engine chose for each token.

An engine that routes a token to other experts than the trainer would (bf16
kernels, near-tied router logits) makes ``logp_behav`` the log-prob of another
network; replaying the engine's choices in every trainer forward that scores
those tokens (the policy forward and backward, every recovery forward) makes
the trainer compute the same network. Routes are a ``[b, n, layers, k]``
integer tensor per forward: for input position t of row b (the token
``tokens[b, t]``, which predicts ``tokens[b, t + 1]``) and MoE layer l (0-based
over all decoder layers), the k expert ids. ``-1`` marks a position without
routes (padding, a prompt the engine gave none for, a request that lost them):
those tokens route live, as without replay.

megatron-core 0.16.1 ships the mechanism: ``moe_enable_routing_replay`` gives
each router a ``RouterReplay`` whose ``get_replay_topk`` replaces the top-k.
Its own replay takes the target for every token of the forward; megarl needs
live routing where routes are unknown, so :func:`install` gives each router's
instance a ``get_replay_topk`` that mixes the two. Megatron's routers see the
tokens sequence-first (``[s * b, experts]`` for an ``[s, b, h]`` input), which is
how :func:`replaying` lays the targets out. Under sequence parallelism each
tensor-parallel rank routes its own contiguous slice of the sequence
(:func:`forward_routes` cuts it); expert parallelism dispatches tokens after
routing, so every rank routes its own tokens and replays them unchanged.
Full activation recompute reruns each layer's forward in the backward, after
the micro-batch's forward returned: there each router takes the routes its
forward queued (megatron's ``REPLAY_BACKWARD``, oldest first), so the gradient
is that of the routes the forward used.

The probabilities of the replayed experts are the router's own scores at those
ids (gathered), so the gradient reaches the router as in a live forward.
tests/unit/test_routing_replay.py checks it against a router forced to the same
top-k, and that replaying the live routes changes no log-prob;
tests/unit/test_recompute.py that full recompute keeps the replayed loss and gradients.
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Iterator

import torch

from megarl.errors import InputError

#: routes of a position the engine gave none for: route it live
NO_ROUTE = -1


def routers(model_chunks) -> list[tuple[int, object]]:
    """``(layer index, RouterReplay)`` of every MoE router of this rank's model chunks, by layer."""
    from megatron.core.transformer.moe.router import TopKRouter  # megatron: after prepare_megatron()

    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and getattr(module, "router_replay", None) is not None:
                found.append((int(module.layer_number) - 1, module.router_replay))
    return sorted(found, key=lambda x: x[0])


def forward_routes(routes: torch.Tensor | None, n: int, pad: int, n_moe_layers: int,
                   sequence_split: tuple[int, int] | None = None) -> torch.Tensor | None:
    """This rank's routes for a forward of ``n`` input positions plus ``pad`` (routed live), or None.

    ``sequence_split`` = (tp rank, tp size) under sequence parallelism: each tensor-parallel rank routes its
    contiguous slice of the (padded) sequence, as megatron scatters it, so it replays the routes of that slice.
    """
    if routes is None:
        return None
    if not n_moe_layers:
        raise InputError("the batch carries MoE routes to replay but the model is dense")
    routes = torch.nn.functional.pad(routes[:, :n], (0, 0, 0, 0, 0, pad), value=NO_ROUTE)
    if sequence_split is None:
        return routes
    rank, size = sequence_split
    chunk = (n + pad) // size
    return routes[:, rank * chunk:(rank + 1) * chunk]


def _mixed_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """``RouterReplay.get_replay_topk`` with live routing where the target is -1 (installed per instance).

    A recomputed forward (``REPLAY_BACKWARD``) takes the oldest target its forwards queued (:func:`replaying`).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    action = self.router_replay_action
    if action == RouterReplayAction.RECORD:
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.record_indices(idx)
        return probs, idx
    if action == RouterReplayAction.REPLAY_BACKWARD:
        if not self.replay_backward_list:
            raise RuntimeError("routing replay: a layer was recomputed more often than it ran forward")
        target = self.replay_backward_list.pop(0)
    elif action == RouterReplayAction.REPLAY_FORWARD:
        target = self.target_topk_idx
    else:
        target = None
    if target is None:
        return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    if target.shape != (scores.shape[0], topk):
        raise ValueError(f"routing replay: routes for {tuple(target.shape)} (tokens, top-k) but the router scores "
                         f"{scores.shape[0]} tokens with top-{topk}")
    _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
    target = target.to(device=scores.device, dtype=torch.long)
    known = (target >= 0).all(dim=-1, keepdim=True)
    idx = torch.where(known, target, live)
    return scores.gather(1, idx), idx


def install(model_chunks) -> int:
    """Give every router of ``model_chunks`` the mixed replay; returns the number of MoE layers found."""
    found = routers(model_chunks)
    for _, replay in found:
        replay.get_replay_topk = types.MethodType(_mixed_topk, replay)
    return len(found)


@contextmanager
def replaying(model_chunks, routes: torch.Tensor | None, *, n_layers: int,
              recompute: bool = False) -> Iterator[None]:
    """Inside the block, the routers of ``model_chunks`` replay ``routes`` ([b, n, layers, k], module doc).

    ``routes`` None: live routing. The forward inside must take exactly ``n`` input positions of ``b`` rows.
    ``recompute``: a backward that reruns each layer's forward (full activation recompute) follows, after the
    block has ended: each router queues this forward's target (None: live) and replays it in the recomputed
    forward, in the order the forwards ran (a pipeline schedule runs backwards in forward order), until
    :func:`fresh` ends the step.
    """
    if routes is None and not recompute:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = routers(model_chunks)
    if routes is not None and (routes.dim() != 4 or routes.shape[2] != n_layers):
        raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}, expected [rows, positions, "
                         f"{n_layers} layers, top-k]")
    try:
        for layer, replay in found:
            target = None
            if routes is not None:
                # sequence-first, as the router sees the tokens: row-major over [n, b]
                b, n, _, k = routes.shape
                target = routes[:, :, layer, :].transpose(0, 1).reshape(n * b, k)
            replay.target_topk_idx = target
            replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            if recompute:
                replay.replay_backward_list.append(target)
        yield
    finally:
        for _, replay in found:
            replay.target_topk_idx = None
            if recompute:  # the recomputed forwards come after the block; the queue stays for them
                replay.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
            else:
                replay.clear_indices()
                replay.clear_router_replay_action()


@contextmanager
def fresh(model_chunks) -> Iterator[None]:
    """One forward(-backward) pass: every router starts and ends it replaying nothing, with no routes queued
    (a pass that failed half way leaves nothing for the next one); recording (:func:`live_routes`) stays on."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = routers(model_chunks)
    replay_actions = (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)

    def clear() -> None:
        for _, replay in found:
            replay.target_topk_idx, replay.replay_backward_list = None, []
            if replay.router_replay_action in replay_actions:
                replay.clear_router_replay_action()

    clear()
    try:
        yield
    finally:
        clear()


def live_routes(trainer, batch) -> torch.Tensor:
    """[B, L-1, layers, k]: the experts ``trainer``'s own routers choose for ``batch`` (no replay; -1 past each
    row), for comparing with an engine's. One trainer rank without sequence parallelism (a measurement)."""
    import dataclasses

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megarl.trainer.microbatch import plan_microbatches

    found = routers(trainer.model)
    if not found:
        raise InputError("live_routes needs an MoE model")
    store: dict[int, list[torch.Tensor]] = {layer: [] for layer, _ in found}
    for layer, replay in found:
        replay.record_indices = lambda idx, layer=layer: store[layer].append(idx.detach().cpu())
        replay.router_replay_action = RouterReplayAction.RECORD
    try:
        trainer.logprobs(dataclasses.replace(batch, routes=None))
    finally:
        for _, replay in found:
            del replay.record_indices  # the class's method again
            replay.clear_indices()
            replay.clear_router_replay_action()
    B, L = batch.tokens.shape
    k = store[found[0][0]][0].shape[-1]
    out = torch.full((B, L - 1, max(store) + 1, k), NO_ROUTE, dtype=torch.int16)
    for i, mb in enumerate(plan_microbatches(batch, 0, 1, trainer.micro_batch_tokens, layout=trainer.packing,
                                             linear_weight=trainer.linear_weight)):  # the plan logprobs ran
        b, n = mb.tokens.shape[0], mb.tokens.shape[1] - 1
        for layer, recorded in store.items():
            out[mb.rows, :n, layer] = recorded[i].reshape(n, b, k).transpose(0, 1).to(torch.int16)
    past = torch.arange(L - 1)[None] >= (batch.seq_lens[:, None] - 1)
    out[past] = NO_ROUTE
    return out


def route_disagreement(engine: torch.Tensor, trainer: torch.Tensor) -> dict[str, float]:
    """Shares of routing decisions (token x layer) and of tokens (any layer) whose expert sets differ between
    ``engine`` and ``trainer`` routes ([B, n, layers, k]), over the positions the engine routed."""
    known = (engine >= 0).all(-1) & (trainer >= 0).all(-1)  # [B, n, layers]
    differ = (engine.sort(-1).values != trainer.sort(-1).values).any(-1) & known
    tokens = known.all(-1)
    return {"routes/n_tokens": float(tokens.sum()), "routes/n_decisions": float(known.sum()),
            "routes/decisions_differ_frac": float(differ.sum()) / max(float(known.sum()), 1.0),
            "routes/tokens_differ_frac": float((differ.any(-1) & tokens).sum()) / max(float(tokens.sum()), 1.0)}
