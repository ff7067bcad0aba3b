"""The tensors one micro-batch enters the model as: a padded rectangle, or THD packed rows.

Both layouts run the same plan (megarl/trainer/packing.py); only the tensors differ.

``padded``: ``[b, n + pad]`` input ids (row t's labels are its next tokens), positions 0.. per row,
padding at the end (causal attention: real positions never see it); ``pad`` makes the length a
multiple of the tensor-parallel size under sequence parallelism. Outputs are cut back to ``[b, n]``.

``thd`` (TransformerEngine attention only; megatron-core's local spec refuses packed sequences):
the rows' inputs concatenated into ``[1, T]``, each row's labels its own next tokens (shifted
within the row, never across rows), each row padded to a multiple of the tensor-parallel size
(sequence parallelism splits T over TP ranks), positions restarting at 0 per row, and
``PackedSeqParams(qkv_format="thd")`` with cumulative lengths: the padded ones drive attention and
RoPE (a row's padding sits after its real tokens, so causal attention keeps real positions exact),
the real ones say where each row's tokens are. MoE routes are replayed in pack order, the padding
routed live. Per-token outputs ``[1, T(, 2)]`` are unpacked back to ``[b, n(, 2)]``, zeros past
each row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: an expert index meaning "route live" (megarl/trainer/routing_replay.py NO_ROUTE)
LIVE = -1


@dataclass
class ThdLayout:
    """Where each row's input positions sit in a packed ``[1, T]`` micro-batch."""

    #: input positions of each row (its length - 1: the last token is only a label)
    lengths: list[int]
    #: each row's positions padded to the multiple
    padded: list[int]

    @property
    def starts(self) -> list[int]:
        out, at = [], 0
        for p in self.padded:
            out.append(at)
            at += p
        return out

    @property
    def total(self) -> int:
        return sum(self.padded)

    def cu_seqlens(self, padded: bool) -> torch.Tensor:
        """int32 [rows + 1]: cumulative (padded) lengths, as TransformerEngine's attention takes them."""
        sizes = torch.tensor([0] + (self.padded if padded else self.lengths), dtype=torch.int32)
        return sizes.cumsum(0, dtype=torch.int32)


def thd_layout(seq_lens: list[int], multiple: int = 1) -> ThdLayout:
    """The layout of rows of ``seq_lens`` tokens, each row's inputs padded to a multiple of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"thd_layout needs multiple >= 1, got {multiple}")
    lengths = [int(n) - 1 for n in seq_lens]
    if min(lengths, default=1) < 1:
        raise ValueError(f"every row needs >= 2 tokens to be scored, got lengths {list(seq_lens)}")
    return ThdLayout(lengths=lengths, padded=[n + (-n % multiple) for n in lengths])


def pack_tokens(tokens: torch.Tensor, layout: ThdLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, labels, position_ids)``, each [1, T], from rows ``tokens`` [b, L] (padding: 0)."""
    T = layout.total
    inputs = torch.zeros(1, T, dtype=tokens.dtype, device=tokens.device)
    labels = torch.zeros_like(inputs)
    positions = torch.zeros_like(inputs)
    for b, (start, n, p) in enumerate(zip(layout.starts, layout.lengths, layout.padded)):
        inputs[0, start:start + n] = tokens[b, :n]
        labels[0, start:start + n] = tokens[b, 1:n + 1]
        positions[0, start:start + p] = torch.arange(p, device=tokens.device)
    return inputs, labels, positions


def pack_routes(routes: torch.Tensor | None, layout: ThdLayout) -> torch.Tensor | None:
    """Routes [b, >= n, layers, k] of the rows as [1, T, layers, k] in pack order; padding routed live."""
    if routes is None:
        return None
    out = torch.full((1, layout.total, *routes.shape[2:]), LIVE, dtype=routes.dtype, device=routes.device)
    for b, (start, n) in enumerate(zip(layout.starts, layout.lengths)):
        out[0, start:start + n] = routes[b, :n]
    return out


def unpack(values: torch.Tensor, layout: ThdLayout) -> torch.Tensor:
    """Per-token outputs [1, T, ...] back to [b, n_max, ...] rows (zeros past each row's end)."""
    width = max(layout.lengths)
    out = values.new_zeros((len(layout.lengths), width, *values.shape[2:]))
    for b, (start, n) in enumerate(zip(layout.starts, layout.lengths)):
        out[b, :n] = values[0, start:start + n]
    return out


def packed_seq_params(layout: ThdLayout, device: torch.device):
    """megatron-core's PackedSeqParams of a THD micro-batch (module doc)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = layout.cu_seqlens(padded=True).to(device)
    longest = max(layout.padded)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=padded, cu_seqlens_kv=padded, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


@dataclass
class ModelInputs:
    """One micro-batch's model call: keyword arguments, its routes as ``forward_routes`` takes them
    (``routes``, ``n`` positions kept, ``pad`` more routed live) and how outputs become [b, n(, 2)]."""

    kwargs: dict
    routes: torch.Tensor | None
    n: int
    pad: int
    unpack: Callable[[torch.Tensor], torch.Tensor]


def model_inputs(layout: str, tokens: torch.Tensor, seq_lens: list[int], routes: torch.Tensor | None,
                 multiple: int) -> ModelInputs:
    """The model call of a micro-batch of rows ``tokens`` [b, L] (trimmed to its longest row)."""
    if layout == "thd":
        thd = thd_layout(seq_lens, multiple)
        inputs, labels, positions = pack_tokens(tokens, thd)
        kwargs = dict(input_ids=inputs, position_ids=positions, attention_mask=None, labels=labels,
                      packed_seq_params=packed_seq_params(thd, tokens.device))
        return ModelInputs(kwargs, pack_routes(routes, thd), thd.total, 0, lambda out: unpack(out, thd))
    n = tokens.shape[1] - 1
    pad = -n % multiple
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad))
    positions = torch.arange(n + pad, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], n + pad)
    kwargs = dict(input_ids=tokens[:, :-1], position_ids=positions, attention_mask=None, labels=tokens[:, 1:])
    return ModelInputs(kwargs, routes, n, pad, lambda out: out[:, :n])


def schedule_shape(layout: str, mbs: list, multiple: int) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` for megatron's schedule: the largest over ``mbs`` (MicroBatch)."""
    if layout == "thd":
        return max(thd_layout(row_lengths(mb), multiple).total for mb in mbs), 1
    return (max(-(-(mb.tokens.shape[1] - 1) // multiple) * multiple for mb in mbs),
            max(mb.tokens.shape[0] for mb in mbs))


def row_lengths(mb) -> list[int]:
    """Token counts of a MicroBatch's rows (a dummy: its filler row)."""
    if mb.batch is None:
        return [int(mb.tokens.shape[1])] * int(mb.tokens.shape[0])
    return [int(n) for n in mb.batch.seq_lens]
