"""The rollout engine interface, shared by the vLLM and HF backends, the HTTP client and the router
(:class:`Engine`), and the router interface the loop drives (:class:`RouterProtocol`).

Semantics every implementation keeps:

- ``generate`` returns, per output token, ``logp_behav``: the log-prob of the
  token under the distribution it was actually sampled from (temperature,
  top-k and top-p applied; greedy when temperature is 0, then the raw
  log-softmax), and ``versions``: the weight version that sampled it.
- Generation stops only at ``SamplingParams.stop_token_ids`` (the caller puts
  the model's EOS there), at ``max_new_tokens``, or at the model's context
  length (``finish_reason`` "length"). A prompt that already fills the
  context raises :class:`InputError` and the engine keeps serving.
- ``abort_all`` ends every in-flight request; each returns its partial output
  with ``finish_reason`` "abort". Resubmitting prompt + partial continues it
  (see :mod:`megarl.rollout.interrupt`).
- Weight updates pause generation (in-flight requests end with "abort"),
  check the update's names and shapes against the model *before* loading
  (a mismatch raises :class:`EngineError` naming the tensor; the engine keeps
  its old weights and keeps serving), load, reset cached prefixes, set
  ``version`` and resume. They return the seconds of each phase of that stall
  (:data:`UPDATE_PHASES`, keys ``engine_<phase>_s``; an engine that does not
  time them returns None).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from megarl.errors import ConfigError, EngineError, InputError
from megarl.platform.cpu_affinity import format_cores
from megarl.types import GenerateRequest, GenerateResult

BACKENDS = ("vllm", "hf")
#: the phases of an engine's weight update, in order: stop in-flight requests, stop scheduling, load the
#: weights, drop cached prefixes (KV of the old weights), label the new version and schedule again
UPDATE_PHASES = ("abort", "pause", "reload", "cache_reset", "resume")
#: weight dtypes an engine can be asked for (`megarl engine --dtype`); see :func:`resolve_dtype`
ENGINE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(dtype: str, config: dict) -> str:
    """The dtype an engine loads its weights in; ``auto`` is the one the checkpoint's config.json records.

    megarl resolves ``auto`` itself instead of handing it to vLLM, whose own
    ``auto`` runs a float32 checkpoint in half precision: engines and trainer
    agree on the precision only if it is stated. transformers 5 writes the
    field as ``dtype``, earlier versions as ``torch_dtype``; absent, float32.
    """
    if dtype != "auto":
        return dtype
    recorded = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(recorded).removeprefix("torch.")


@runtime_checkable
class Engine(Protocol):
    """An asynchronous rollout engine (in-process backend, HTTP client, or router over several)."""

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Continue ``req.prompt_ids``; returns tokens with per-token logp_behav and versions."""

    async def abort_all(self) -> None:
        """End every in-flight request now; each returns its partial output with "abort"."""

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float] | None:
        """Load the safetensors checkpoint in directory ``path`` and call it ``version``; the phases' seconds."""

    async def update_weights_from_broadcast(self, group_info: dict, names_shapes_dtypes: list,
                                            version: int) -> dict[str, float] | None:
        """Join/reuse the trainer's broadcast group (``group_info`` incl. "rank") and load its stream; the
        phases' seconds."""

    async def version(self) -> int:
        """The weight version new tokens are sampled with."""

    async def health(self) -> dict:
        """Liveness and load: at least {"ok", "backend", "version", "in_flight"}."""

    async def pause(self) -> None:
        """Stop scheduling new tokens; in-flight requests end with "abort", new ones wait."""

    async def resume(self) -> None:
        """Undo :meth:`pause`."""

    async def close(self) -> None:
        """Release the engine (processes, memory)."""


@runtime_checkable
class RouterProtocol(Engine, Protocol):
    """Several engines behind one :class:`Engine`, as the loop drives them (EngineSupervisor, EngineRouter).

    A request whose engine died raises :class:`~megarl.rollout.supervisor.EngineLost`; the caller waits
    with :meth:`wait_available` and sends it again.
    """

    #: set when no engine is left and none will come back (the run cannot go on); None otherwise
    failure: EngineError | None

    async def wait_available(self) -> None:
        """Return once an engine can take a request; raise ``failure`` when none will."""

    def stats(self) -> dict[str, int]:
        """Per-run totals for the step record (engine failures, restarts, live engines)."""

    def fail_busy(self, reason: str) -> None:
        """The engines holding requests missed a deadline (``reason``): restart them, or raise an EngineError."""


class PhaseClock:
    """Seconds spent in each phase of a weight update (:data:`UPDATE_PHASES`); a phase may be entered twice."""

    def __init__(self) -> None:
        self._s = dict.fromkeys(UPDATE_PHASES, 0.0)

    @contextmanager
    def phase(self, name: str):
        if name not in self._s:
            raise ValueError(f"unknown update phase {name!r}; one of {UPDATE_PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._s[name] += time.perf_counter() - t0

    def total(self) -> float:
        return sum(self._s.values())

    def seconds(self) -> dict[str, float]:
        """``{"engine_abort_s": ..., ...}``, every phase present (0 for one not entered)."""
        return {f"engine_{k}_s": v for k, v in self._s.items()}


def slowest_phases(results: list) -> dict[str, float] | None:
    """Per phase, the largest seconds over several engines' update results (dicts or None): the engines
    update concurrently, so the slowest one sets each phase of the stall. None when none timed its phases."""
    timed = [r for r in results if isinstance(r, dict)]
    if not timed:
        return None
    return {k: max(float(r.get(k, 0.0)) for r in timed) for k in timed[0]}


def effective_max_new_tokens(req: GenerateRequest, max_model_len: int) -> int:
    """``max_new_tokens`` clamped to the context; InputError if the prompt leaves no room."""
    n_prompt = len(req.prompt_ids)
    if n_prompt == 0:
        raise InputError(f"request {req.request_id}: empty prompt")
    if n_prompt >= max_model_len:
        raise InputError(f"request {req.request_id}: prompt has {n_prompt} tokens but the model's context "
                         f"(max_position_embeddings) is {max_model_len}; shorten the prompt to at most "
                         f"{max_model_len - 1} tokens")
    if req.sampling.max_new_tokens < 0:
        raise InputError(f"request {req.request_id}: max_new_tokens {req.sampling.max_new_tokens} < 0")
    return min(req.sampling.max_new_tokens, max_model_len - n_prompt)


def logprob_temperature(temperature: float) -> float:
    """The temperature ``logp_behav`` is taken at, for scoring the same tokens in the trainer: the sampling
    temperature, or 1 for greedy sampling (0), whose reported log-probs are the raw log-softmax."""
    return temperature if temperature > 0 else 1.0


def truncates_sampling(top_p: float, top_k: int, vocab_size: int = 0) -> bool:
    """True when top-p or top-k leave tokens out, so that ``logp_behav`` is the log-prob of a
    renormalized truncated distribution rather than of softmax(logits / T) (``vocab_size`` 0: unknown)."""
    return top_p < 1.0 or (top_k > 0 and not 0 < vocab_size <= top_k)


def check_request(req: GenerateRequest, vocab_size: int) -> None:
    """InputError for token ids outside the vocabulary or sampling settings no backend accepts."""
    bad = [t for t in req.prompt_ids + list(req.sampling.stop_token_ids) if not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"request {req.request_id}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    s = req.sampling
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < -1:
        raise InputError(f"request {req.request_id}: need temperature >= 0, 0 < top_p <= 1, top_k >= -1 "
                         f"(got {s.temperature}, {s.top_p}, {s.top_k})")


def wants_routed_experts(rollout) -> bool:
    """Whether engines start with vLLM's routed-experts output (``rollout``: the run's RolloutConfig): with
    rollout.routing_replay on the vllm backend, whose GPU engines return MoE routes only when started for them."""
    return rollout.routing_replay and rollout.backend == "vllm"


def engine_options(backend: str, kv_cache_gb: int, cpu_threads: int, cpu_cores: list[int] | tuple = (), *,
                   kv_block_size: int = 0) -> dict:
    """``make_engine`` options for an engine's CPU resources (``rollout.kv_cache_gb``, ``rollout.cpu_threads``,
    ``placement.cpu_affinity.engines`` or the same-named command flags), so that no engine megarl starts depends
    on VLLM_CPU_KVCACHE_SPACE or OMP_NUM_THREADS being set; all apply on CPU only (``cpu_threads`` 0: left to
    the environment). With ``cpu_cores`` the engine pins itself to them and runs one thread per core.
    ``kv_block_size`` (rollout.kv_block_size, --kv-block-size; 0: vLLM's own): tokens per KV-cache block of a
    vllm engine, on any device."""
    if kv_block_size < 0 or (kv_block_size and backend != "vllm"):
        raise ConfigError(f"rollout.kv_block_size (--kv-block-size) is the vllm engine's KV-cache block: a number of "
                          f"tokens >= 1, or 0 for vLLM's own; got {kv_block_size} with the {backend} engine"
                          + ("" if backend == "vllm" else ", which has no paged KV cache: set it to 0"))
    if kv_cache_gb < 1:
        raise ConfigError(f"rollout.kv_cache_gb (--kv-cache-gb) must be >= 1 GiB, got {kv_cache_gb}")
    if cpu_threads < 0:
        raise ConfigError(f"rollout.cpu_threads (--cpu-threads) must be >= 0 (0: the environment's), got {cpu_threads}")
    if cpu_cores:
        cpu_threads = len(cpu_cores)
    options: dict = {"cpu_threads": cpu_threads} if cpu_threads else {}
    if cpu_cores:
        options["cpu_cores"] = list(cpu_cores)
    if backend == "vllm":
        options["kv_cache_gib"] = kv_cache_gb
    if kv_block_size:
        options["block_size"] = kv_block_size
    return options


def resources_note(health: dict) -> str:
    """", kv cache N GiB, T CPU thread(s), on core(s) C, kv block B tokens, prefix cache on" from an engine's
    health, the parts that apply ("" for none)."""
    parts = []
    if health.get("kv_cache_gb") is not None:
        parts.append(f"kv cache {health['kv_cache_gb']:g} GiB")
    if health.get("cpu_threads") is not None:
        parts.append(f"{health['cpu_threads']} CPU thread(s)")
    if health.get("cpu_cores"):
        parts.append(f"on core(s) {format_cores(health['cpu_cores'])}")
    if health.get("kv_block_size") is not None:
        cache = "on" if health.get("prefix_caching") else "off"
        parts.append(f"kv block {health['kv_block_size']} tokens, prefix cache {cache}")
    return "".join(f", {p}" for p in parts)

