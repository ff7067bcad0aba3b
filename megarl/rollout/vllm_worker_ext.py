"""Methods megarl injects into vLLM's worker (``worker_extension_cls``) to update weights in place.

vLLM mixes this class into its worker class and asserts that no name clashes
with a worker attribute (``reload_weights`` and ``update_weights`` exist
already), hence the ``megarl_`` prefix. Call through
``AsyncLLM.collective_rpc("megarl_...")`` with generation paused: the RPC
blocks the engine core until it returns.

Why not ``model.load_weights`` directly: on CPU the linear layers repack
their weights after loading and leave ``weight`` empty, so a direct load
fails half-way. ``model_runner.reload_weights`` restores the checkpoint
layout, loads, and re-runs each layer's post-load processing.

vLLM is imported inside the methods: this module is loaded by vLLM's workers,
which have it, but it must stay importable without vLLM (a GPU machine may
lack the wheel, and the module is named in megarl's own code).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from megarl.errors import EngineError
from megarl.platform.amx import request_amx_if_asked
from megarl.rollout.engine_shards import quantized_update_error
from megarl.rollout.vllm_routes import install_capture, pack_histories
from megarl.rollout.weight_spec import safetensors_files
from megarl.rollout.weight_sync import join_weight_group, receive_named_tensors

# vLLM imports this module in each worker process before it loads the model: a bf16 engine's workers ask for
# AMX state here, before their first forward (megarl/platform/amx.py)
request_amx_if_asked()


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _tp_rank() -> int:
    """This worker's rank in the engine's vLLM tensor-parallel group (0 without TP)."""
    from vllm.distributed import parallel_state  # vLLM: module doc

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


class MegarlWorkerExtension:
    """Weight updates from disk or from a trainer broadcast (see megarl.rollout.weight_sync), and the capture
    of MoE routes where vLLM cannot return them (megarl.rollout.vllm_routes)."""

    #: (key, group, device) of the trainer's broadcast group this worker joined (None: none yet)
    _megarl_pg: tuple | None = None
    #: the router hooks' recorder, installed by the first megarl_capture_routes (None: nothing hooked)
    _megarl_routes = None

    def megarl_capture_routes(self) -> int:
        """Start recording the routes of requests that ask for them (idempotent); returns the MoE layer count."""
        if self._megarl_routes is None:
            self._megarl_routes = install_capture(self.model_runner)
        return len(self._megarl_routes.layer_ids)

    def megarl_take_routes(self, request_id: str):
        """The forward histories recorded for a finished request (megarl.rollout.vllm_routes.RouteRecorder.take),
        removed, packed for the reply (vllm_routes.pack_histories)."""
        return None if self._megarl_routes is None else pack_histories(self._megarl_routes.take(request_id))

    def megarl_routes_pending(self) -> int:
        """Requests whose recorded routes were not taken yet (0 when nothing is hooked)."""
        return 0 if self._megarl_routes is None else self._megarl_routes.pending()

    def megarl_load_from_disk(self, path: str) -> int:
        """Reload every tensor of the safetensors checkpoint at ``path``; returns how many."""
        if not Path(path).is_dir():
            raise FileNotFoundError(f"weight update directory {path} does not exist")
        return self._megarl_reload(_safetensors_weights(path))

    def megarl_load_from_broadcast(self, group_info: dict, drain_only: bool = False) -> int:
        """Receive the trainer's broadcast and load it (or only drain it, when the update was refused).

        A receive is bounded (megarl/rollout/receiver_group.py): when the publish is called off or
        stalls, this raises ``BroadcastLeft`` and the group is dropped; the engine then loads the disk copy.
        """
        pg, device = self._megarl_group(group_info)
        stream = receive_named_tensors(pg, device)
        try:
            if drain_only:
                return sum(1 for _ in stream)
            return self._megarl_reload(stream)
        except Exception:
            self._megarl_pg = None  # a group that failed a publish is never used again
            raise

    # -- helpers -----------------------------------------------------------------------------
    def _megarl_group(self, group_info: dict):
        """Join the trainer's group on the first update and keep it for the following ones.

        ``group_info["rank"]`` is the engine's first rank; an engine with vLLM tensor
        parallelism k has k workers, and worker t joins as that rank + t. With
        ``group_info["shards"]`` k, worker t joins sub-group t and receives only its slices,
        each widened back to the full shape (megarl/rollout/engine_shards.py); otherwise every
        worker receives the full tensors. Either way its own ``load_weights`` keeps its shard. The group
        rendezvouses on megarl's authenticated store (megarl/rollout/rendezvous.py), not on
        vLLM's stateless ``TCPStore``, which anyone reaching the port could write.
        """
        rank = int(group_info["rank"]) + _tp_rank()
        key = (group_info["host"], int(group_info["port"]), rank, int(group_info["world_size"]),
               group_info.get("backend", "gloo"), group_info.get("group_id"))
        cached = self._megarl_pg
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        group, _store, device = join_weight_group({**group_info, "rank": rank})
        self._megarl_pg = (key, group, device)
        return group, device

    def _megarl_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config  # vLLM: module doc

        quantization = getattr(self.vllm_config.model_config, "quantization", None)
        if quantization:  # megarl/preflight.py refuses such a checkpoint first; an engine started otherwise too
            raise EngineError(quantized_update_error(str(quantization)))
        count = [0]

        def counted():
            for item in weights:
                count[0] += 1
                yield item

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=counted())
            self._megarl_fix_after_reload()
        return count[0]

    def _megarl_fix_after_reload(self) -> None:
        """Redo two post-load steps that vLLM's in-place reload skips (both silently wrong otherwise).

        1. Fused MoE: the unquantized fused-MoE method copies the new expert
           weights into place but skips ``moe_kernel.fused_experts.
           process_weights_after_loading`` (it runs only on the first load).
           The CPU experts prepack their weights there, so a reloaded MoE model
           computes with unpacked weights.
        2. Tied embeddings: ``lm_head`` shares ``embed_tokens.weight`` but
           loads nothing itself, so its post-load step is not re-run; on CPU
           that step packs the weight into a GEMM handle, which keeps the old
           weights (log-probs of the old model's output layer, ~1 nat off).
        Both steps are idempotent and no-ops where nothing is packed (GPU).
        Only for these unquantized methods: a quantized method's post-load step
        converts the checkpoint's tensors in place (NVFP4 scales them, block
        FP8 pads and swizzles), so re-running it would do it twice; megarl
        refuses updates of quantized engines (:meth:`_megarl_reload`), and this
        skips every other method anyway (:func:`rerun_after_reload`).
        Guarded by tests/e2e/test_vllm_engine.py (dense tied, MoE untied).
        """
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            step = rerun_after_reload(method, module)
            if step == "fused_experts":
                method.moe_kernel.fused_experts.process_weights_after_loading(module)
            elif step == "embedding":
                method.process_weights_after_loading(module)


def rerun_after_reload(method, module) -> str | None:
    """Which post-load step :meth:`MegarlWorkerExtension._megarl_fix_after_reload` re-runs for a module whose
    ``quant_method`` is ``method``: ``"fused_experts"`` for vLLM's unquantized fused MoE (directly or wrapped in
    the modular method), ``"embedding"`` for an unquantized embedding with weights, None for anything else
    (a quantized method's step is not idempotent)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # vLLM
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # vLLM

    base = getattr(method, "old_quant_method", method)  # FusedMoEModularMethod wraps the layer's own method
    if getattr(method, "moe_kernel", None) is not None and isinstance(base, UnquantizedFusedMoEMethod):
        return "fused_experts"
    if isinstance(method, UnquantizedEmbeddingMethod) and module.weight.numel() > 0:
        return "embedding"
    return None
