"""MoE routes from vLLM (megarl/rollout/vllm_routes.py) without an engine: the native output's conversion, the
mapping of a step's token rows to requests, and the recorder the worker extension fills."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.rollout.vllm_routes import (
    RouteRecorder,
    Span,
    native_routes,
    pack_rows,
    routes_from_rows,
    split_step,
    unpack_rows,
)


def test_native_rows_become_per_position_routes():
    # vLLM's routed_experts for a 3-token prompt and 2 generated tokens: 4 rows (the last token is never fed),
    # 2 layers, top-2, uint8
    rows = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]]], dtype=np.uint8)
    routes = routes_from_rows(rows, 5)
    assert routes == [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]], []]
    assert isinstance(routes[0][0][0], int)
    # routed_experts_prompt_start=2: the rows start at position 2
    assert routes_from_rows(rows[2:], 5, start=2) == [[], [], [[2, 3], [0, 1]], [[3, 0], [1, 2]], []]
    # an aborted request that never ran a step, and captured rows with a gap (-1: not computed)
    assert routes_from_rows(None, 3) == [[], [], []]
    gap = np.array([[[0, 1]], [[-1, -1]], [[2, 3]]], dtype=np.int16)
    assert routes_from_rows(gap, 4) == [[[0, 1]], [], [[2, 3]], []]
    # rows past the last position (a token fed before an abort dropped its successor) are not kept
    assert routes_from_rows(gap, 2) == [[[0, 1]], []]
    # vLLM's own output must hold one row per fed position; otherwise (a preempted request's lost rows) its
    # rows cannot be placed and the request has no routes
    assert native_routes(rows, 5) == routes
    assert native_routes(rows[1:], 5) is None and native_routes(rows, 6) is None
    assert native_routes(None, 3) == [[], [], []]  # aborted before its first step


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

    pre = rec.take("pre")  # the id it was submitted under; vLLM appended "-bb"
    assert pre.dtype == np.int16 and pre.shape == (4, 2, 2)
    assert pre.tolist() == [[[1, 2], [3, 0]], [[2, 3], [0, 1]], [[3, 0], [1, 2]], [[0, 2], [1, 3]]]
    dec = rec.take("dec-aa")  # or its internal id
    assert dec.shape == (7, 2, 2) and (dec[:6] == -1).all() and dec[6].tolist() == [[0, 1], [2, 3]]
    assert rec.take("pre") is None and rec.pending() == 0
    assert (unpack_rows(pack_rows(dec)) == dec).all() and unpack_rows(pack_rows(None)) is None


def test_a_recomputed_position_keeps_its_later_rows():
    rec = RouteRecorder([0])
    rec.arm([Span("r", 0, 2, 0)], 2)
    _forward(rec, {0: [[0, 1], [1, 2]]})
    rec.arm([Span("r", 0, 3, 0)], 3)  # preempted, then prompt + output computed again
    _forward(rec, {0: [[0, 1], [2, 3], [3, 0]]})
    assert rec.take("r").tolist() == [[[0, 1]], [[2, 3]], [[3, 0]]]


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
    assert asyncio.run(_unstarted_engine(tmp_path, "tiny_qwen3_moe").generate(nothing)).routes == [[], [], []]
