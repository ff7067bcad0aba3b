"""Route segments (megarl/routes.py): storage, wire format, and which routes each forward replays, on hand numbers.

Positions follow TrainBatch convention: a segment routed input positions [0, end) and made the predictions
at [start, end). Routes here have 1 MoE layer and top-1 unless said otherwise.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megarl.config.schema import RolloutConfig
from megarl.errors import EngineError
from megarl.rollout.interruptible import InterruptibleGeneration
from megarl.routes import (
    RouteSegment,
    append_segment,
    as_int16,
    compact,
    decode,
    encode,
    known,
    newest_routes,
    request_segments,
    scoring_units,
)
from megarl.types import GenerateRequest, GenerateResult, TrainBatch, Trajectory
from recovery._scoring import scoring_segments


def rows(*experts: int) -> np.ndarray:
    """[positions, 1 layer, top-1]; -1: no route."""
    return np.array(experts, dtype=np.int64).reshape(-1, 1, 1)


def test_routes_take_the_smallest_dtype_and_keep_unknown_positions():
    small = compact(rows(3, -1, 254))
    assert small.dtype == np.uint8 and small.ravel().tolist() == [3, 255, 254]
    assert known(small).ravel().tolist() == [True, False, True]
    assert as_int16(small).ravel().tolist() == [3, -1, 254]
    wide = compact(rows(300, -1))
    assert wide.dtype == np.int16 and wide.ravel().tolist() == [300, -1]
    assert known(wide).ravel().tolist() == [True, False]
    # vLLM's native uint8 output of a 256-expert model: 255 is expert 255, not "no route"
    from megarl.rollout.vllm_routes import native_histories

    (_, native), = native_histories(np.array([[[255, 3]]], dtype=np.uint8), 2)
    seg, = request_segments([(0, native)], prompt_len=1, n_output=1)
    assert seg.routes.dtype == np.int16 and known(seg.routes).all() and seg.routes.ravel().tolist() == [255, 3]
    # the wire form is base64 .npy: JSON-safe, dtype and shape kept
    for a in (small, wide):
        back = decode(json.loads(json.dumps(encode(a))))
        assert back.dtype == a.dtype and np.array_equal(back, a)


def test_a_result_with_route_segments_survives_json():
    res = GenerateResult("r", [7, 8], [-0.5, -0.25], [3, 3], "stop",
                         routes=[RouteSegment(2, compact(rows(1, 2, 3, 0)), version=3)])
    back = GenerateResult.from_dict(json.loads(json.dumps(res.to_dict())))
    (seg,) = back.routes
    assert (seg.start, seg.end, seg.version) == (2, 4, 3) and seg.routes.ravel().tolist() == [1, 2, 3, 0]
    assert GenerateResult.from_dict(json.loads(json.dumps(GenerateResult("r", [], [], [], "abort").to_dict()))).routes \
        is None


def test_request_segments_own_from_the_last_prompt_position():
    # a 3-token prompt, 2 generated tokens: positions 0..3 fed; predictions at 2 and 3
    (seg,) = request_segments([(0, rows(0, 1, 2, 3))], prompt_len=3, n_output=2)
    assert (seg.start, seg.end) == (2, 4)
    # an aborted request whose last step fed its second token and dropped the third it sampled: that position
    # is the resubmission's to predict
    (seg,) = request_segments([(0, rows(0, 1, 2, 3, 1))], prompt_len=3, n_output=2)
    assert (seg.start, seg.end) == (2, 4)
    # a history that fed only part of the prompt (recomputed before its first token) predicted nothing
    (seg,) = request_segments([(0, rows(0, 1)), (2, rows(0, 1, 2, 3))], prompt_len=3, n_output=2)
    assert (seg.start, seg.end) == (2, 4)


def test_segments_of_one_version_that_agree_are_one_segment_and_others_stay_apart():
    segs: list[RouteSegment] = []
    append_segment(segs, RouteSegment(1, compact(rows(0, 1, 2)), version=4))
    # the same version resubmitted (an engine restart): its prefix routes agree, one segment reaches further
    append_segment(segs, RouteSegment(3, compact(rows(0, 1, 2, 3, 0)), version=4))
    assert len(segs) == 1 and (segs[0].start, segs[0].end) == (1, 5)
    # the same version routing the prefix elsewhere (a near-tie computed in another batch): kept apart
    append_segment(segs, RouteSegment(5, compact(rows(0, 3, 2, 3, 0, 1)), version=4))
    assert len(segs) == 2
    # the next version re-prefilled the prefix with its own experts: a segment of its own
    append_segment(segs, RouteSegment(6, compact(rows(1, 3, 2, 3, 0, 1, 2)), version=5))
    assert [(s.start, s.end, s.version) for s in segs] == [(1, 5, 4), (5, 6, 4), (6, 7, 5)]


def _two_version_row():
    """A row spliced across versions 0 and 1: prompt of 2, tokens 0..2 by v0, 3..5 by v1."""
    t = Trajectory("t", "g", [1, 2], [4, 5, 6, 7, 8, 9], [0.0] * 6, [0, 0, 0, 1, 1, 1], [1] * 6)
    # v0's request: positions 0..3 fed, predictions 1..3; v1's re-prefilled 0..4 with other experts at 0 and 2
    t.add_route_segment(RouteSegment(1, compact(rows(0, 1, 2, 3)), version=0))
    t.add_route_segment(RouteSegment(4, compact(rows(3, 1, 0, 3, 2, 1, 0)), version=1))
    return t


def test_the_policy_forward_replays_the_newest_route_of_every_position():
    batch = TrainBatch.from_trajectories([_two_version_row()], version=2)
    assert batch.routes.shape == (1, 7, 1, 1)
    assert batch.routes.ravel().tolist() == [3, 1, 0, 3, 2, 1, 0]
    # positions the newest segment does not know keep an older segment's route
    segs = [RouteSegment(1, compact(rows(0, 1, 2, 3))), RouteSegment(4, compact(rows(-1, 2, 2, 2, 2)))]
    assert newest_routes([segs], 6)[0].ravel().tolist() == [0, 2, 2, 2, 2, -1]


def test_a_forward_at_a_tokens_version_replays_its_own_segments_routes():
    batch = TrainBatch.from_trajectories([_two_version_row()], version=2)
    (u0,) = scoring_units(batch, 0)
    # v0's tokens are predicted at indices 1..3, with v0's routes (positions past its end route live)
    assert u0.mask.nonzero().ravel().tolist() == [1, 2, 3]
    assert u0.routes.ravel().tolist() == [0, 1, 2, 3, -1, -1, -1]
    (u1,) = scoring_units(batch, 1)
    # v1's tokens at 4..6 replay v1's routes of the whole prefix, not v0's
    assert u1.mask.nonzero().ravel().tolist() == [4, 5, 6]
    assert u1.routes.ravel().tolist() == [3, 1, 0, 3, 2, 1, 0]
    # tokens no segment of their version owns route live
    bare = Trajectory("b", "g", [1, 2], [4, 5], [0.0] * 2, [0, 0], [1, 1])
    units = scoring_units(TrainBatch.from_trajectories([_two_version_row(), bare], version=2), 0)
    assert [(u.row, u.routes is None) for u in units] == [(0, False), (1, True)]
    # and the dedicated scorer's pieces follow the same owners
    pieces = scoring_segments(_two_version_row())
    assert [(s.start, s.end, s.version, rs.version) for s, rs in pieces] == [(0, 3, 0, 0), (3, 6, 1, 1)]


def _gen(strict: bool) -> InterruptibleGeneration:
    return InterruptibleGeneration(None, RolloutConfig(routing_replay=True, routing_replay_strict=strict), seed=0,
                                   counters={"n_routes_missing": 0})


def test_a_trajectory_takes_each_segment_with_the_version_of_the_tokens_it_generated():
    t = Trajectory("t", "g", [1, 2, 3])
    req = GenerateRequest("t/0/0", [1, 2, 3])
    res = GenerateResult("t/0/0", [4, 5], [-0.1, -0.2], [7, 7], "stop",
                         routes=[RouteSegment(2, compact(rows(0, 1, 2, 3)))])
    _gen(strict=True)._take_routes(t, req, res, counted=True)
    assert [(s.start, s.end, s.version) for s in t.route_segments] == [(2, 4, 7)]


def test_a_segment_whose_tokens_span_versions_or_a_misplaced_prompt_is_refused():
    res = GenerateResult("t/0/0", [4, 5], [-0.1, -0.2], [7, 8], "stop",
                         routes=[RouteSegment(2, compact(rows(0, 1, 2, 3)))])
    with pytest.raises(EngineError, match=r"versions \[7, 8\]"):
        _gen(strict=True)._take_routes(Trajectory("t", "g", [1, 2, 3]), GenerateRequest("t/0/0", [1, 2, 3]), res, True)
    lax = _gen(strict=False)
    t = Trajectory("t", "g", [1, 2, 3])
    lax._take_routes(t, GenerateRequest("t/0/0", [1, 2, 3]), res, True)
    assert t.route_segments == [] and lax.counters["n_routes_missing"] == 1
    # a prompt that is not the trajectory's tokens so far: its positions cannot be placed
    ok = GenerateResult("t/0/0", [4], [-0.1], [7], "stop", routes=[RouteSegment(2, compact(rows(0, 1, 2)))])
    with pytest.raises(EngineError, match="cannot be placed"):
        _gen(strict=True)._take_routes(Trajectory("t", "g", [1, 2, 9]), GenerateRequest("t/0/0", [1, 2, 3]), ok, True)


def test_route_bytes_are_one_byte_per_layer_and_expert_below_255_experts():
    seg = RouteSegment(9, compact(torch.randint(0, 128, (10, 48, 8))))
    assert seg.nbytes == 10 * 48 * 8
