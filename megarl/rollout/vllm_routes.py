"""MoE routes from a vLLM engine, as forward histories for :func:`megarl.routes.request_segments`.

Two sources, one format. Both give forward histories ``(first owned position,
rows)``, rows ``[positions, layers, k]`` of expert ids from position 0 of
prompt + output; ``megarl.routes.request_segments`` turns them into
``GenerateResult.routes`` (one route segment per history).

- **Native** (vLLM on GPU, started with ``enable_return_routed_experts``): the
  final ``CompletionOutput.routed_experts`` is a numpy array
  ``[num_tokens - 1 - routed_experts_prompt_start, num_layers, top_k]``
  (uint8 with at most 256 experts, else uint16) covering positions
  ``routed_experts_prompt_start`` .. the one before the last token, which is
  never fed back. vLLM fills prefix-cached prompt positions from its own
  store, and an aborted request returns the rows of the steps it ran; a
  preempted request loses rows, and a result whose rows are not one per fed
  position gets no routes (:func:`native_histories`; the caller counts it in
  ``n_routes_missing``).
- **Captured** (vLLM on CPU, whose build refuses the native output): megarl's
  worker extension hooks each MoE layer's router (the ``capture_fn`` vLLM's
  routers call with the top-k ids of every token row, before any expert-map
  remapping) and, per scheduler step, maps the batch's token rows to requests:
  the model runner lays out ``input_batch.req_ids`` in order, each with its
  ``num_scheduled_tokens`` rows at positions ``num_computed_tokens`` onward
  (:func:`split_step`). :class:`RouteRecorder` keeps, per request that asked
  (``SamplingParams.extra_args[ROUTES_ARG]``), the rows of every step until
  the engine takes them after the request ends; positions no step computed
  are ``-1`` rows. Requests that ask do not read the prefix cache
  (``skip_reading_prefix_cache``): a cached prompt position is not recomputed
  and would have no route, so every position is computed instead (a cache miss
  costs one prefill; other requests still use the cache). A step that computes
  a position again (vLLM's recompute after a preemption) starts a new
  history: the tokens sampled before it attended to the first rows, the later
  ones to the recomputed rows (:meth:`RouteRecorder.take`). Nothing is hooked
  before the first request that asks, so an engine that is never asked for
  routes runs exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

#: the ``SamplingParams.extra_args`` key by which a request asks the worker to record its routes
ROUTES_ARG = "megarl_routes"


def native_histories(rows, n_positions: int) -> list[tuple[int, np.ndarray]] | None:
    """The forward history of vLLM's ``routed_experts`` (requested from position 0) for
    :func:`megarl.routes.request_segments`, or None when its rows are not one per fed position (vLLM drops a
    preempted request's rows): they could not be placed. No rows (nothing fed): no history."""
    if rows is None:
        return []
    if len(rows) != n_positions - 1:
        return None
    # uint8 ids of a 256-expert model include 255, which megarl's compact uint8 uses for "no route"
    return [(0, np.asarray(rows, dtype=np.int64))]


def pack_histories(histories: list[tuple[int, np.ndarray]] | None):
    """Histories as (first, shape, int16 bytes) triples for an RPC reply: vLLM's utility replies do not turn an
    ndarray back."""
    if histories is None:
        return None
    return [(first, list(rows.shape), np.ascontiguousarray(rows, dtype=np.int16).tobytes())
            for first, rows in histories]


def unpack_histories(packed) -> list[tuple[int, np.ndarray]] | None:
    """The histories of :func:`pack_histories`."""
    if packed is None:
        return None
    return [(first, np.frombuffer(data, dtype=np.int16).reshape(shape)) for first, shape, data in packed]


@dataclass(frozen=True)
class Span:
    """One request's rows in a step's batch: rows ``row``..``row + n`` are its positions ``position``.."""
    request_id: str
    row: int
    n: int
    position: int


def split_step(req_ids, num_scheduled, num_computed, wanted) -> list[Span]:
    """The spans of the ``wanted`` requests in one step, whose batch holds ``req_ids`` in order, each with
    ``num_scheduled[i]`` token rows starting at its position ``num_computed[i]`` (the model runner's layout)."""
    spans, row = [], 0
    for rid, n, first in zip(req_ids, num_scheduled, num_computed):
        n = int(n)
        if rid in wanted and n > 0:
            spans.append(Span(rid, row, n, int(first)))
        row += n
    return spans


class RouteRecorder:
    """The top-k ids each MoE layer chose in one step, sorted to the requests that asked for them."""

    def __init__(self, layer_ids) -> None:
        #: the model's MoE layer ids, in order; a route's layer index is the position in this list
        self.layer_ids = sorted(layer_ids)
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}
        self._spans: list[Span] = []
        self._n_rows = 0
        self._step: dict[int, torch.Tensor] = {}
        #: request id -> [(first position, rows [n, layers, k] int16)], in step order
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def arm(self, spans: list[Span], n_rows: int) -> None:
        """The next forward is a step with ``n_rows`` token rows, ``spans`` of them wanted."""
        self._spans, self._n_rows, self._step = spans, n_rows, {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """A router's choice for every row of the running forward (a router's ``capture_fn``)."""
        if self._spans:  # forwards outside an armed step (warm-up, profiling) and steps nobody asked for
            self._step[layer_id] = topk_ids[:self._n_rows].to(torch.int16)

    def commit(self) -> None:
        """After the forward: file the armed step's rows under the requests they belong to."""
        spans, self._spans = self._spans, []
        if not spans:
            return
        if len(self._step) != len(self.layer_ids):
            raise RuntimeError(f"routing capture: {len(self._step)} of {len(self.layer_ids)} MoE layers reported "
                               f"their experts in this step")
        rows = torch.stack([self._step[layer] for layer in self.layer_ids], dim=1).cpu()
        self._step = {}
        for s in spans:
            self._chunks.setdefault(s.request_id, []).append((s.position, rows[s.row:s.row + s.n]))

    def take(self, request_id: str) -> list[tuple[int, np.ndarray]]:
        """Remove and return the forward histories recorded for ``request_id`` (vLLM's internal id, or the id it
        was submitted under, to which vLLM appends ``-<suffix>``), as ``(first owned position, rows)`` with rows
        ``[positions, layers, k]`` int16 from position 0, -1 where no step computed the position; empty when
        nothing was recorded. A step that computes a position again (vLLM's recompute after a preemption)
        starts a new history: the tokens sampled before it attended to the earlier rows, those after it to
        the recomputed ones. The new history keeps the earlier rows of positions it did not recompute."""
        keys = [k for k in self._chunks if k == request_id or k.rsplit("-", 1)[0] == request_id]
        chunks = [c for k in keys for c in self._chunks.pop(k)]
        if not chunks:
            return []
        end = max(first + len(rows) for first, rows in chunks)
        out = torch.full((end, *chunks[0][1].shape[1:]), -1, dtype=torch.int16)
        histories, covered, owned_from, next_pos = [], 0, 0, 0
        for first, rows in chunks:  # in step order
            if first < next_pos:  # recomputed: the history so far ends where it had got to
                histories.append((owned_from, out[:covered].numpy().copy()))
                owned_from = covered
            out[first:first + len(rows)] = rows
            next_pos = first + len(rows)  # a chunked prefill's next chunk starts here
            covered = max(covered, next_pos)
        histories.append((owned_from, out[:covered].numpy()))
        return histories

    def pending(self) -> int:
        """Requests with rows not taken yet."""
        return len(self._chunks)


def _wants_routes(state) -> bool:
    params = getattr(state, "sampling_params", None)
    return bool(params is not None and (params.extra_args or {}).get(ROUTES_ARG))


def install_capture(model_runner) -> RouteRecorder:
    """Hook the model's MoE routers and the runner's step (module doc); returns the recorder."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter  # vLLM: the worker has it
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runners = [m for m in model_runner.get_model().modules() if isinstance(m, MoERunner)]
    if not runners:
        raise RuntimeError("routing capture: the model has no MoE layers")
    unsupported = [type(m.router).__name__ for m in runners if m.is_monolithic or not isinstance(m.router, BaseRouter)]
    if unsupported:
        raise RuntimeError(f"routing capture: MoE layers route inside a monolithic kernel or through "
                           f"{unsupported[0]}, whose choice cannot be observed")
    recorder = RouteRecorder(m.layer_id for m in runners)
    for m in runners:
        m.router.set_capture_fn(partial(recorder.capture, m.layer_id))

    prepare, forward = model_runner._prepare_inputs, model_runner._model_forward

    def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = model_runner.input_batch
        ids = list(batch.req_ids[:batch.num_reqs])
        wanted = {r for r in ids if _wants_routes(model_runner.requests.get(r))}
        recorder.arm(split_step(ids, num_scheduled_tokens, batch.num_computed_tokens_cpu[:len(ids)], wanted)
                     if wanted else [], int(np.sum(num_scheduled_tokens)))
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    def model_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        recorder.commit()
        return out

    model_runner._prepare_inputs, model_runner._model_forward = prepare_inputs, model_forward
    return recorder
