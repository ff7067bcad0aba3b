"""HF transformers rollout backend: the reference for vLLM, and the fallback where vLLM is absent.

Plain token-by-token decoding with a KV cache, one request at a time, on one
worker thread (so the asyncio loop serving HTTP stays responsive). The model
is only touched from that thread, so weight updates queue behind the running
request, which an abort ends at the next token. Sampling follows vLLM's
order (temperature, then top-k, then top-p) and ``logp_behav`` is the
log-prob under exactly that processed distribution (see
:func:`processed_logprobs`); temperature 0 is greedy with the raw log-softmax.
"""
from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from megarl.errors import EngineError, InputError
from megarl.models.hf_config import is_moe
from megarl.rollout.base import PhaseClock, check_request, effective_max_new_tokens, resolve_dtype
from megarl.rollout.weight_spec import (
    check_update_specs,
    read_checkpoint_specs,
    read_config,
    safetensors_files,
    tied_optional_names,
)
from megarl.rollout.weight_sync import join_weight_group, receive_named_tensors
from megarl.routes import request_segments
from megarl.types import GenerateRequest, GenerateResult, SamplingParams


def processed_logprobs(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """Log-probs of the distribution sampled from: log_softmax(mask_top_p(mask_top_k(logits / T))).

    Top-p keeps the smallest set of most likely tokens whose mass reaches p
    (a token is dropped when the mass of the tokens less likely than it,
    itself included, is <= 1 - p), as vLLM does.
    """
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x)
        cum = torch.cumsum(torch.softmax(sorted_x, -1), -1)
        drop = cum <= 1.0 - s.top_p
        drop[-1] = False  # always keep the most likely token
        x = x.clone()
        x[order[drop]] = float("-inf")
    return torch.log_softmax(x, -1)


# from_pretrained builds the model under process-global context managers (meta-device init):
# two engines loading at once in one process corrupt each other's load
_LOAD_LOCK = threading.Lock()


def resolve_device(device: str) -> str:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _load_model(checkpoint: str | Path, device: str, dtype: str = "float32"):
    """The checkpoint as a transformers model in ``dtype`` (the loader casts whatever dtype is stored)."""
    import transformers  # lazy: heavy, loaded only when an HF engine is built

    with _LOAD_LOCK:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype))
    return model.to(device).eval()


class HFEngine:
    """Create with ``await HFEngine.create(checkpoint)``."""

    backend = "hf"

    def __init__(self, model, checkpoint: str, config: dict, initial_version: int, device: str,
                 dtype: str = "float32") -> None:
        self.model = model
        #: weight dtype, kept across weight updates (an update in another dtype is cast on load)
        self.dtype = dtype
        self.checkpoint = checkpoint
        self.config = config
        self.device = device
        self.max_model_len = int(config["max_position_embeddings"])
        self.vocab_size = int(config["vocab_size"])
        #: experts per token of an MoE model (its routes are recorded on request); 0 for a dense one
        self._top_k = int(config.get("num_experts_per_tok") or 0) if is_moe(config) else 0
        self._reference = read_checkpoint_specs(checkpoint)
        self._optional = tied_optional_names(config)
        self._version = initial_version
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-hf-engine")
        self._abort_epoch = 0  # requests submitted before the last abort end at their next token
        self._in_flight = 0
        self._gate: asyncio.Event | None = None  # cleared while paused; made inside the serving loop
        self._update_lock: asyncio.Lock | None = None
        self._user_paused = False
        self._group = None  # (key, process group, store, device) of the trainer's broadcast group
        self.last_update_s: float | None = None
        #: seconds of each phase of the last weight update (engine_abort_s, engine_pause_s, ...)
        self.last_update_phases: dict[str, float] = {}
        #: the cores this engine's process is pinned to (None: not pinned by megarl)
        self.cpu_cores: list[int] | None = None

    @classmethod
    async def create(cls, checkpoint: str, *, initial_version: int = 0, device: str = "auto",
                     seed: int = 0, dtype: str | None = None, cpu_threads: int | None = None) -> "HFEngine":
        """``dtype``: "float32" (default), "bfloat16", or "auto" (the checkpoint's recorded dtype).
        ``cpu_threads``: torch threads of this process when the engine runs on the CPU (None: unchanged)."""
        config = read_config(checkpoint)
        dtype = resolve_dtype(dtype or "float32", config)
        device = resolve_device(device)
        if cpu_threads and device == "cpu":
            torch.set_num_threads(cpu_threads)
        try:
            model = await asyncio.to_thread(_load_model, checkpoint, device, dtype)
        except Exception as e:
            raise EngineError(f"HF engine for {checkpoint} failed to start: {type(e).__name__}: {e}") from e
        return cls(model, str(checkpoint), config, initial_version, device, dtype)

    def _events(self) -> tuple[asyncio.Event, asyncio.Lock]:
        if self._gate is None:
            self._gate, self._update_lock = asyncio.Event(), asyncio.Lock()
            self._gate.set()
        return self._gate, self._update_lock

    # -- generation ----------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        check_request(req, self.vocab_size)
        max_new = effective_max_new_tokens(req, self.max_model_len)
        gate, _ = self._events()
        self._in_flight += 1
        try:
            await gate.wait()
            epoch = self._abort_epoch
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self._generate_sync, req, max_new, epoch)
        finally:
            self._in_flight -= 1

    @torch.no_grad()
    def _generate_sync(self, req: GenerateRequest, max_new: int, epoch: int) -> GenerateResult:
        s = req.sampling
        gen = torch.Generator().manual_seed(s.seed if s.seed is not None else random.getrandbits(63))
        stop = set(s.stop_token_ids)
        out_ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        reason = "length"
        inputs = torch.tensor([req.prompt_ids], dtype=torch.long, device=self.device)
        past = None
        routing = req.return_routes and self._top_k > 0
        routes: list = []
        for _ in range(max_new):
            if self._abort_epoch != epoch:
                reason = "abort"
                break
            out = self.model(input_ids=inputs, past_key_values=past, use_cache=True,
                             **({"output_router_logits": True} if routing else {}))
            past = out.past_key_values
            if routing:  # the experts this model's routers chose for the positions just fed
                routes.append(torch.stack([r.topk(self._top_k, dim=-1).indices for r in out.router_logits],
                                          dim=1).cpu().numpy())
            logits = out.logits[0, -1].float().cpu()
            if s.temperature == 0:
                lp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(logits))
            else:
                lp = processed_logprobs(logits, s)
                tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            out_ids.append(tok)
            logps.append(float(lp[tok]))
            versions.append(self._version)
            if tok in stop:
                reason = "stop"
                break
            inputs = torch.tensor([[tok]], dtype=torch.long, device=self.device)
        if not routing:
            return GenerateResult(req.request_id, out_ids, logps, versions, reason)
        # one forward history: the prompt and every generated token but the last (never fed back)
        history = [(0, np.concatenate(routes))] if routes else []
        return GenerateResult(req.request_id, out_ids, logps, versions, reason,
                              routes=request_segments(history, len(req.prompt_ids), len(out_ids)))

    async def abort_all(self) -> None:
        self._abort_epoch += 1

    # -- weight updates ------------------------------------------------------------------------
    async def _paused_update(self, fn, *args, version: int) -> dict[str, float]:
        """Stop new requests, end the running one, load, resume; returns each phase's seconds (the pause is
        the wait for the running request to reach its next token; there is no prefix cache to reset)."""
        gate, _ = self._events()
        clock = PhaseClock()
        with clock.phase("abort"):
            gate.clear()
            self._abort_epoch += 1
        started: list[float] = []

        def timed_load() -> None:
            started.append(time.perf_counter())
            fn(*args)

        t_submit = time.perf_counter()
        try:
            # runs after the current request, which the abort ends at its next token
            with clock.phase("reload"):
                await asyncio.get_running_loop().run_in_executor(self._pool, timed_load)
            self._version = version
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"weight update failed: {type(e).__name__}: {e}") from e
        finally:
            if not self._user_paused:
                with clock.phase("resume"):
                    gate.set()
        phases = clock.seconds()
        waited = started[0] - t_submit if started else 0.0  # in the executor's queue behind the running request
        phases["engine_pause_s"] += waited
        phases["engine_reload_s"] -= waited
        self.last_update_s = clock.total()
        self.last_update_phases = phases
        return phases

    def _load_from_dir(self, weights_dir: str) -> None:
        """Load safetensors (without config.json) via from_pretrained, which maps checkpoint names."""
        with tempfile.TemporaryDirectory(prefix="megarl-hf-update-") as tmp:
            shutil.copy(Path(self.checkpoint) / "config.json", Path(tmp) / "config.json")
            for f in safetensors_files(weights_dir):
                (Path(tmp) / f.name).symlink_to(f.resolve())
            self.model = _load_model(tmp, self.device, self.dtype)

    async def update_weights_from_disk(self, path: str, version: int) -> dict[str, float]:
        _, lock = self._events()
        async with lock:
            if not Path(path).is_dir():
                raise EngineError(f"weight update directory {path} does not exist")
            specs = read_checkpoint_specs(path)
            check_update_specs(self._reference, [(n, s, d) for n, (s, d) in specs.items()], self._optional,
                               source=f"update from {path}")
            return await self._paused_update(self._load_from_dir, str(path), version=version)

    def _receive(self, group_info: dict, keep: bool) -> None:
        key = tuple(group_info.get(k) for k in ("host", "port", "rank", "world_size", "backend", "group_id"))
        if self._group is None or self._group[0] != key:
            self._group = (key, *join_weight_group(group_info))
        _, pg, _, device = self._group
        tensors = {name: t.to("cpu").clone() for name, t in receive_named_tensors(pg, device)}
        if keep:
            with tempfile.TemporaryDirectory(prefix="megarl-hf-bcast-") as tmp:
                save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
                self._load_from_dir(tmp)

    async def update_weights_from_broadcast(self, group_info: dict, names_shapes_dtypes: list,
                                            version: int) -> dict[str, float]:
        if "rank" not in group_info:
            raise InputError("broadcast group_info lacks this engine's 'rank' (1..world_size-1)")
        _, lock = self._events()
        async with lock:
            try:
                check_update_specs(self._reference, names_shapes_dtypes, self._optional, source="broadcast update")
            except EngineError:
                # drain the stream so the trainer's broadcast completes, keep the old weights
                await asyncio.get_running_loop().run_in_executor(self._pool, self._receive, group_info, False)
                raise
            return await self._paused_update(self._receive, group_info, True, version=version)

    # -- control -------------------------------------------------------------------------------
    async def version(self) -> int:
        return self._version

    async def health(self) -> dict:
        return {"ok": True, "backend": self.backend, "dtype": self.dtype, "version": self._version,
                "in_flight": self._in_flight,
                "checkpoint": self.checkpoint, "max_model_len": self.max_model_len,
                "paused": self._user_paused, "last_update_s": self.last_update_s,
                "cpu_threads": torch.get_num_threads() if self.device == "cpu" else None, "cpu_cores": self.cpu_cores}

    async def pause(self) -> None:
        gate, _ = self._events()
        self._user_paused = True
        gate.clear()
        self._abort_epoch += 1

    async def resume(self) -> None:
        gate, _ = self._events()
        self._user_paused = False
        gate.set()

    async def close(self) -> None:
        self._abort_epoch += 1
        self._pool.shutdown(wait=True)
