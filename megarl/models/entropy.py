"""The policy's per-token entropy, computed inside the training forward (vocab-parallel under TP).

An entropy bonus (``loss.entropy_coef``) needs H(pi_theta(. | tokens[..t])) at
every position, with its gradient, and that needs the full-vocabulary logits:
only the output layer has them. megarl's GPTModel returns the per-token cross
entropy for its labels (``compute_language_model_loss``); :func:`install` wraps
that method so that, while :func:`returning_entropy` is active, the model
returns ``[b, s, 2]``: the cross entropy (= -logp) in channel 0 and the
entropy in channel 1. Outside it nothing changes (no extra work, same shape).

Both are of the distribution the engines sample from, softmax(logits / T), in
fp32. Under tensor parallelism the logits are vocab shards: the maximum, the
partition function Z = sum exp(x - max) and sum exp(x - max) * x are reduced
over the TP group, with megatron's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward), so the gradient is exact and every
rank gets the full entropy, H = log Z + max - (sum exp(x - max) x) / Z.
Memory: an fp32 copy of the logits and the tensors of its graph while it runs.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

_FLAG = "megarl_return_entropy"


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the last dim of ``logits`` ([..., v / tp], this TP rank's vocab shard), in fp32.

    The shift by the maximum only keeps exp finite; H does not depend on it, so it carries no gradient."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    x = logits.float()
    shift = x.detach().amax(dim=-1, keepdim=True)
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp > 1:
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    e = torch.exp(x - shift)
    sums = torch.stack([e.sum(-1), (e * x).sum(-1)], -1)
    if tp > 1:
        sums = reduce_from_tensor_model_parallel_region(sums)
    z, ex = sums[..., 0], sums[..., 1]
    return torch.log(z) + shift.squeeze(-1) - ex / z


def install(model, temperature: float = 1.0) -> None:
    """Make ``model`` (a GPTModel) score its labels at ``temperature`` and, on request, return the entropy too.

    The engines sample from softmax(logits / T) and report that distribution's
    log-probs as logp_behav, so the trainer's log-probs are taken at the same
    T: the logits are divided on the way into the vocab-parallel cross
    entropy, as the output layer gives them (shards under TP) and in fp32, as
    the engines divide their fp32 logits (a bf16 quotient would round once
    more). T = 1 leaves the logits as they are.
    """
    plain = model.compute_language_model_loss
    setattr(model, _FLAG, False)

    def language_model_loss(labels, logits):
        x = logits.float() / temperature if temperature != 1.0 else logits
        if not getattr(model, _FLAG):
            return plain(labels, x)
        # megatron's vocab-parallel cross entropy works in place on the logits it is given: the entropy's
        # graph keeps its own copy. Logits are [s, b, v / tp]; the cross entropy comes back as [b, s].
        ent = vocab_parallel_entropy(x.float().clone())
        return torch.stack([plain(labels, x).float(), ent.transpose(0, 1)], dim=-1)

    model.compute_language_model_loss = language_model_loss


@contextlib.contextmanager
def returning_entropy(chunks: Iterable[torch.nn.Module], on: bool = True) -> Iterator[None]:
    """While active (and ``on``), every installed GPTModel inside ``chunks`` returns [b, s, 2]: (-logp, entropy)."""
    models = [m for chunk in chunks for m in chunk.modules() if hasattr(m, _FLAG)] if on else []
    for m in models:
        setattr(m, _FLAG, True)
    try:
        yield
    finally:
        for m in models:
            setattr(m, _FLAG, False)
