"""MoE routes from vLLM (megarl/rollout/vllm_routes.py) without an engine: the native output's conversion, the
mapping of a step's token rows to requests, and the recorder the worker extension fills."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.rollout.vllm_routes import (
    RouteRecorder,
    Span,
    native_histories,
    pack_histories,
    split_step,
    unpack_histories,
)
from megarl.routes import request_segments


def test_native_rows_become_one_route_segment():
    # vLLM's routed_experts for a 3-token prompt and 2 generated tokens: 4 rows (the last token is never fed),
    # 2 layers, top-2, uint8
    rows = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]]], dtype=np.uint8)
    seg, = request_segments(native_histories(rows, 5), prompt_len=3, n_output=2)
    # it owns the predictions from the last prompt position (2) on, and routed positions 0..3
    assert (seg.start, seg.end) == (2, 4) and seg.routes.tolist() == rows.tolist()
    # vLLM's own output must hold one row per fed position; otherwise (a preempted request's lost rows) its
    # rows cannot be placed and the request has no routes
    assert native_histories(rows[1:], 5) is None and native_histories(rows, 6) is None
    assert native_histories(None, 3) == []  # aborted before its first step: nothing routed


def test_a_step_with_one_request_in_prefill_and_one_decoding():
    # the runner's batch: "dec" decodes one token at position 6, "pre" prefills its 4-token prompt, "other"
    # (not asking for routes) decodes one token; rows are laid out in that order
    spans = split_step(["dec-1a2b", "pre-3c4d", "other-5e6f"], np.array([1, 4, 1]), np.array([6, 0, 9]),
                       {"dec-1a2b", "pre-3c4d"})
    assert spans == [Span("dec-1a2b", 0, 1, 6), Span("pre-3c4d", 1, 4, 0)]
    # a request scheduled for no tokens this step takes no rows
    assert split_step(["a", "b"], [0, 2], [5, 3], {"a", "b"}) == [Span("b", 0, 2, 3)]


def _forward(rec: RouteRecorder, ids_per_layer: dict[int, list[list[int]]], padded: int = 0) -> None:
    """One model forward: each MoE layer reports its top-k for every row (plus ``padded`` rows past the batch)."""
    for layer, ids in ids_per_layer.items():
        rec.capture(layer, torch.tensor(ids + [[0, 0]] * padded, dtype=torch.int32))
    rec.commit()


def test_the_recorder_files_each_step_under_its_requests():
    rec = RouteRecorder([5, 3])  # layer ids as vLLM numbers them; index 0 is layer 3
    # step 1: "pre" prefills 3 positions, "dec" decodes at position 6 (rows: dec, pre, pre, pre)
    rec.arm(split_step(["dec-aa", "pre-bb"], [1, 3], [6, 0], {"dec-aa", "pre-bb"}), 4)
    _forward(rec, {3: [[0, 1], [1, 2], [2, 3], [3, 0]], 5: [[2, 3], [3, 0], [0, 1], [1, 2]]}, padded=2)
    # step 2: "pre" decodes at position 3
    rec.arm(split_step(["pre-bb"], [1], [3], {"pre-bb"}), 1)
    _forward(rec, {3: [[0, 2]], 5: [[1, 3]]})
    # a forward nobody armed (warm-up) and a step nobody asked for record nothing
    _forward(rec, {3: [[1, 1]], 5: [[1, 1]]})
    rec.arm([], 1)
    _forward(rec, {3: [[1, 1]], 5: [[1, 1]]})

    (first, pre), = rec.take("pre")  # the id it was submitted under; vLLM appended "-bb"
    assert first == 0 and pre.dtype == np.int16 and pre.shape == (4, 2, 2)
    assert pre.tolist() == [[[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]], [[0, 2], [1, 3]]]
    (_, dec), = rec.take("dec-aa")  # or its internal id
    assert dec.shape == (7, 2, 2) and (dec[:6] == -1).all() and dec[6].tolist() == [[0, 1], [2, 3]]
    assert rec.take("pre") == [] and rec.pending() == 0
    (f, back), = unpack_histories(pack_histories([(0, dec)]))
    assert f == 0 and (back == dec).all() and unpack_histories(pack_histories(None)) is None


def test_a_recompute_starts_a_new_forward_history():
    rec = RouteRecorder([0])
    # a 2-token prompt prefilled, then one decode step at position 2: positions 0..2 routed, 2 tokens sampled
    rec.arm([Span("r", 0, 2, 0)], 2)
    _forward(rec, {0: [[0, 1], [1, 2]]})
    rec.arm([Span("r", 0, 1, 2)], 1)
    _forward(rec, {0: [[2, 0]]})
    # preempted; the recompute prefills positions 0..3 in two chunks (0..1, then 2..3), routing position 1
    # elsewhere, then decodes position 4
    rec.arm([Span("r", 0, 2, 0)], 2)
    _forward(rec, {0: [[0, 1], [2, 3]]})
    rec.arm([Span("r", 0, 2, 2)], 2)
    _forward(rec, {0: [[2, 0], [3, 0]]})
    rec.arm([Span("r", 0, 1, 4)], 1)
    _forward(rec, {0: [[1, 3]]})
    (f0, h0), (f1, h1) = rec.take("r")
    # the first history routed positions 0..2 and made the predictions up to position 2; the tokens after it
    # attend to the recomputed rows, and the chunked prefill's second chunk continues the recompute
    assert f0 == 0 and h0.tolist() == [[[0, 1]], [[1, 2]], [[2, 0]]]
    assert f1 == 3 and h1.tolist() == [[[0, 1]], [[2, 3]], [[2, 0]], [[3, 0]], [[1, 3]]]
    first, second = request_segments([(f0, h0), (f1, h1)], prompt_len=2, n_output=4)
    assert (first.start, first.end, second.start, second.end) == (1, 3, 3, 5)


def test_a_step_missing_a_layer_is_an_error():
    rec = RouteRecorder([0, 1])
    rec.arm([Span("r", 0, 1, 0)], 1)
    rec.capture(0, torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="1 of 2 MoE layers"):
        rec.commit()


def test_engines_start_for_routes_only_with_routing_replay_on_vllm():
    from megarl.builder import load_run_config
    from megarl.rollout.base import wants_routed_experts

    on = ["rollout.routing_replay=true"]
    assert wants_routed_experts(load_run_config(None, [*on, "rollout.backend=vllm"]).rollout)
    assert not wants_routed_experts(load_run_config(None, [*on, "rollout.backend=hf"]).rollout)
    assert not wants_routed_experts(load_run_config(None, ["rollout.backend=vllm"]).rollout)


def _unstarted_engine(tmp_path, model: str):
    """A VLLMEngine around no vLLM (what runs before vLLM is asked) on a tiny checkpoint."""
    from pathlib import Path

    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.vllm_engine import VLLMEngine
    from megarl.rollout.weight_spec import read_config

    ckpt = write_tiny_checkpoint(Path(__file__).resolve().parents[2] / f"configs/models/{model}.yaml",
                                 tmp_path / model, seed=0)
    return VLLMEngine(None, str(ckpt), read_config(ckpt), 0)


def test_a_gpu_engine_started_without_routed_experts_refuses_a_request_for_routes(tmp_path):
    import asyncio

    from megarl.errors import InputError
    from megarl.types import GenerateRequest, SamplingParams

    req = GenerateRequest("r", [1, 2], SamplingParams(), return_routes=True)
    engine = _unstarted_engine(tmp_path, "tiny_qwen3_moe")
    engine._routes_source = None  # what create leaves on GPU without routed_experts=True
    with pytest.raises(InputError, match="started without routed experts.*--routed-experts"):
        asyncio.run(engine._routes_for(req))
    # a dense model has no routes to give: the request is served without them
    assert asyncio.run(_unstarted_engine(tmp_path, "tiny_qwen3")._routes_for(req)) is None


def test_a_request_with_nothing_to_generate_routes_nothing(tmp_path):
    # answered before vLLM is asked, as the hf engine answers it: every position without routes
    import asyncio

    from megarl.types import GenerateRequest, SamplingParams

    nothing = GenerateRequest("f", [1, 2, 3], SamplingParams(max_new_tokens=0), return_routes=True)
    assert asyncio.run(_unstarted_engine(tmp_path, "tiny_qwen3_moe").generate(nothing)).routes == []
