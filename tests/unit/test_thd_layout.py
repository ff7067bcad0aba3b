"""THD packed micro-batches (megarl/trainer/layouts.py), the parts that run without TransformerEngine:
cumulative lengths, labels shifted within each row, positions, routes in pack order, unpacking, and a
causal attention over the packed rows (masked by the padded cumulative lengths, as TE's THD attention
is) against the same attention over the padded rectangle."""
from __future__ import annotations

from pathlib import Path

import torch

from megarl.trainer.layouts import (
    LIVE,
    model_inputs,
    pack_routes,
    pack_tokens,
    packed_seq_params,
    schedule_shape,
    thd_layout,
    unpack,
)
from megarl.trainer.microbatch import MicroBatch

TOKENS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [9, 10, 11, 12, 0]])
SEQ_LENS = [5, 3, 4]


def test_cumulative_lengths_real_and_padded_to_the_tp_multiple():
    lay = thd_layout(SEQ_LENS, multiple=2)
    assert lay.lengths == [4, 2, 3] and lay.padded == [4, 2, 4] and lay.starts == [0, 4, 6] and lay.total == 10
    assert lay.cu_seqlens(padded=False).tolist() == [0, 4, 6, 9]
    assert lay.cu_seqlens(padded=True).tolist() == [0, 4, 6, 10]
    assert lay.cu_seqlens(padded=True).dtype == torch.int32
    # every row on its own (as TransformerEngine's context parallelism needs), not only the total
    assert thd_layout(SEQ_LENS, multiple=4).padded == [4, 4, 4]
    params = packed_seq_params(lay, torch.device("cpu"))
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 4
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 4, 6, 10]


def test_labels_shift_within_each_row_and_positions_restart():
    inputs, labels, positions = pack_tokens(TOKENS, thd_layout(SEQ_LENS, multiple=2))
    assert inputs.tolist() == [[1, 2, 3, 4, 6, 7, 9, 10, 11, 0]]
    assert labels.tolist() == [[2, 3, 4, 5, 7, 8, 10, 11, 12, 0]]  # never the next row's first token
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]


def test_routes_in_pack_order_with_the_padding_routed_live():
    routes = (torch.arange(3)[:, None] * 10 + torch.arange(4)[None]).view(3, 4, 1, 1)  # row * 10 + position
    packed = pack_routes(routes, thd_layout(SEQ_LENS, multiple=2))
    assert packed.shape == (1, 10, 1, 1)
    assert packed.flatten().tolist() == [0, 1, 2, 3, 10, 11, 20, 21, 22, LIVE]
    assert pack_routes(None, thd_layout(SEQ_LENS)) is None


def test_unpacking_gives_rows_back_with_zeros_past_their_ends():
    lay = thd_layout(SEQ_LENS, multiple=2)
    values = torch.arange(10.0).view(1, 10)
    assert unpack(values, lay).tolist() == [[0, 1, 2, 3], [4, 5, 0, 0], [6, 7, 8, 0]]
    pairs = torch.stack([values, -values], dim=-1)  # the entropy rides as a second channel
    assert unpack(pairs, lay)[2].tolist() == [[6, -6], [7, -7], [8, -8], [0, 0]]


def _attention(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention of positions x [s, d] onto each other where ``allowed`` [s, s]."""
    scores = (x @ x.T).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ x


def test_attention_over_packed_rows_equals_the_rectangle_per_row():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(16, 8, generator=g, dtype=torch.float64)  # token embeddings
    pos_table = torch.randn(8, 8, generator=g, dtype=torch.float64)  # positional embeddings
    for multiple in (1, 2, 4):
        # the rectangle: causal per row, padding after the real tokens
        rect = model_inputs("padded", TOKENS, SEQ_LENS, None, multiple)
        x = table[rect.kwargs["input_ids"]] + pos_table[rect.kwargs["position_ids"]]
        s = x.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        want = rect.unpack(torch.stack([_attention(row, causal) for row in x]).sum(-1))
        # packed: causal within each segment of the padded cumulative lengths
        thd = model_inputs("thd", TOKENS, SEQ_LENS, None, multiple)
        cu = thd.kwargs["packed_seq_params"].cu_seqlens_q_padded
        seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())
        same = seg[:, None] == seg[None, :]
        xp = table[thd.kwargs["input_ids"][0]] + pos_table[thd.kwargs["position_ids"][0]]
        T = xp.shape[0]
        got = thd.unpack(_attention(xp, same & torch.ones(T, T, dtype=torch.bool).tril()).sum(-1)[None])
        mask = torch.arange(4)[None] < torch.tensor(SEQ_LENS)[:, None] - 1
        assert torch.allclose(got * mask, want * mask, atol=1e-12, rtol=0), multiple
        assert thd.n == T and thd.pad == 0 and T % multiple == 0


def test_the_rectangle_and_the_schedule_shapes():
    rect = model_inputs("padded", TOKENS, SEQ_LENS, None, multiple=3)  # 4 positions padded to 6
    assert rect.kwargs["input_ids"].shape == (3, 6) and rect.n == 4 and rect.pad == 2
    assert rect.kwargs["labels"][0].tolist() == [2, 3, 4, 5, 0, 0]
    mb = MicroBatch(rows=[0, 1, 2], tokens=TOKENS, batch=None)
    dummy = MicroBatch(rows=[], tokens=torch.zeros(1, 2, dtype=torch.long), batch=None, dummy=True)
    assert schedule_shape("padded", [mb, dummy], 3) == (6, 3)
    # without a batch a micro-batch's rows count as full width: 3 rows of 5 tokens, 4 positions each
    assert schedule_shape("thd", [mb, dummy], 2) == (12, 1)


def test_the_trainer_refuses_thd_on_the_local_layers(tmp_path):
    import pytest

    from megarl.errors import ConfigError
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.trainer.megatron_trainer import MegatronTrainer

    repo = Path(__file__).resolve().parents[2]
    ckpt = write_tiny_checkpoint(repo / "configs/models/tiny_qwen3.yaml", tmp_path / "ckpt", seed=1)
    with pytest.raises(ConfigError, match="trainer.packing=thd needs TransformerEngine attention"):
        MegatronTrainer(str(ckpt), packing="thd")
    assert MegatronTrainer(str(ckpt), packing="auto").packing == "padded"
