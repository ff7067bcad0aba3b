"""CPU adaptations megatron-core 0.16.1 needs to run without CUDA, in one place.

megatron-core is written for GPUs. Its real code path (GPTModel with the local
layer spec, Megatron DDP, the Megatron optimizer, the pipeline schedules, the
MoE dispatchers) runs on CPU with gloo once six things are adapted; each patch
below says what fails without it (measured on a 2-core CPU machine):

1. ``torch.cuda.current_device()`` (~175 call sites, RoPE first) returns the
   CPU device, so ``device=torch.cuda.current_device()`` allocates on CPU.
2. Hard-coded ``device="cuda"`` (causal mask, schedules' token counters,
   optimizer ``found_inf``, ``clip_grads``): tensor factories and
   ``Tensor.to``/``Tensor.cuda``/``Module.cuda`` map cuda -> cpu.
3. RNG: the default tracker calls ``torch.cuda.get_rng_state``; megarl seeds
   with ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``
   (:func:`seed_model_parallel_rng`) which keeps CPU generator states.
4. ``clip_grads`` and the optimizer constructors assert
   ``param.type() == 'torch.cuda.FloatTensor'`` (``'torch.cuda.BFloat16Tensor'``
   for the bf16 parameters of mixed-precision training): inside exactly those
   functions ``Tensor.type()`` reports the CUDA type name.
5. The MoE alltoall dispatcher creates CUDA streams/events (stand-ins here)
   and converts its split sizes to numpy only ``if tensor.is_cuda``; gloo's
   ``all_to_all_single`` raises TypeError on tensor splits, so on CPU they are
   always converted.
6. Activation recomputation (``trainer.recompute``): megatron's checkpoint
   function saves and restores the CUDA generator state around each rerun
   (``torch.cuda.get_rng_state`` asserts without CUDA); on CPU the CPU
   generator and the tracker's states, which it saves too, are all there is.
(Without TransformerEngine, 0.16.1's MoE router also references the undefined
name ``te_general_gemm``; that fix is not CPU-specific and lives in
megarl/platform/__init__.py, applied on GPUs without TE too.)

Patches are applied only when ``torch.cuda.is_available()`` is False, at most
once per process (:func:`apply_cpu_patches` is idempotent), and never on a GPU
machine. ``torch.cuda.is_available()`` itself keeps returning False, so other
libraries (HF transformers, vLLM) keep choosing their CPU paths.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from typing import Any, Callable

import torch

_APPLIED = False
#: name -> original object, for tests and for debugging (never restored in-process)
ORIGINALS: dict[str, Any] = {}

# Tensor factories that megatron calls with a literal device="cuda".
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "as_tensor", "rand", "randn",
              "randint", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like")


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (str, torch.device, int index) to the CPU device; leave others alone."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a bare index means cuda:<index>
    return device


def block_broken_transformer_engine() -> None:
    """Make a broken TransformerEngine install look absent.

    A CUDA build of TE raises RuntimeError at import on a machine without
    cudnn, and megatron.core catches only ImportError, so ``import
    megatron.core`` would crash. A ``None`` entry in ``sys.modules`` turns
    every later ``import transformer_engine`` into an ImportError.
    """
    if "transformer_engine" in sys.modules:
        return
    try:
        import transformer_engine  # noqa: F401  (GPU-only package: probed, never required)
    except ImportError:
        pass
    except (RuntimeError, OSError):
        for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
            del sys.modules[name]
        sys.modules["transformer_engine"] = None  # type: ignore[assignment]


# -- 1. current device ----------------------------------------------------------
def _patch_current_device() -> None:
    ORIGINALS["torch.cuda.current_device"] = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    # set_device/synchronize/empty_cache raise on a CPU-only build; megatron calls them for bookkeeping.
    for name in ("set_device", "synchronize", "empty_cache"):
        ORIGINALS[f"torch.cuda.{name}"] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, lambda *a, **k: None)


# -- 2. device="cuda" -> cpu ------------------------------------------------------
def _wrap_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
            # pinned memory needs a CUDA runtime; these tensors stay on CPU anyway
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__megarl_cpu_patch__ = True  # type: ignore[attr-defined]
    return factory


def _patch_device_strings() -> None:
    # Cache torch's own list of device-aware constructors before wrapping them:
    # the `with torch.device(...)` mode HF from_pretrained uses looks the
    # called function up in that cached set. Computed after wrapping, the set
    # holds our wrappers, torch.arange is no longer recognized, and HF's RoPE
    # inv_freq comes out wrong (logits off by 0.2-0.3).
    from torch.utils._device import _device_constructors  # private torch API: touched only on the CPU path

    _device_constructors()
    for name in _FACTORIES:
        fn = getattr(torch, name)
        ORIGINALS[f"torch.{name}"] = fn
        setattr(torch, name, _wrap_factory(fn))

    tensor_to = torch.Tensor.to
    ORIGINALS["torch.Tensor.to"] = tensor_to

    @functools.wraps(tensor_to)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign]

    ORIGINALS["torch.Tensor.cuda"] = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    ORIGINALS["torch.nn.Module.cuda"] = torch.nn.Module.cuda
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


# -- 3. RNG -----------------------------------------------------------------------
def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron's RNG tracker on CPU (the default tracker reads CUDA RNG state).

    The inference tracker's ``fork()`` is a no-op: with dropout 0 and weights
    loaded from a checkpoint, megarl draws nothing from the per-group streams.
    """
    from megatron.core import tensor_parallel  # megatron: imported after the patches are applied

    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


# -- 4. 'torch.cuda.FloatTensor' type asserts ---------------------------------------
@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, ``t.type()`` of a CPU tensor reports 'torch.cuda.<T>' (in this thread only:
    megarl may save checkpoints from a worker thread meanwhile)."""
    original = torch.Tensor.type
    owner = threading.get_ident()

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and threading.get_ident() == owner:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapped.__megarl_cpu_patch__ = True  # type: ignore[attr-defined]
    return wrapped


def _patch_type_asserts() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer  # megatron: patched here

    for mod in (clip_grads, optimizer):  # optimizer.py imported the function by name
        ORIGINALS[f"{mod.__name__}.clip_grad_by_total_norm_fp32"] = mod.clip_grad_by_total_norm_fp32
    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    optimizer.clip_grad_by_total_norm_fp32 = wrapped

    cls = optimizer.Float16OptimizerWithFloat16Params
    ORIGINALS["Float16OptimizerWithFloat16Params.__init__"] = cls.__init__
    cls.__init__ = _with_cuda_type_names(cls.__init__)

    dist = distrib_optimizer.DistributedOptimizer
    build = dist.__dict__["_build_model_and_main_param_groups"].__func__  # a classmethod
    ORIGINALS["DistributedOptimizer._build_model_and_main_param_groups"] = build
    dist._build_model_and_main_param_groups = classmethod(_with_cuda_type_names(build))


# -- 5. MoE dispatcher streams/events and split sizes --------------------------------
class _CpuEvent:
    """Stand-in for torch.cuda.Event: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuStream:
    """Stand-in for torch.cuda.Stream (one implicit, synchronous CPU stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        # there is only one CPU "stream": megatron compares current_stream() with its side stream
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


def _cpu_move_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU version of moe_utils.maybe_move_tensor_to_cpu: converts to numpy even off-GPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _patch_moe() -> None:
    _current_stream = _CpuStream()
    for name, value in (("Stream", _CpuStream), ("Event", _CpuEvent),
                        ("current_stream", lambda *a, **k: _current_stream),
                        ("stream", lambda *a, **k: contextlib.nullcontext())):
        ORIGINALS[f"torch.cuda.{name}"] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, value)

    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # megatron: patched here

    for mod in (moe_utils, token_dispatcher):
        ORIGINALS[f"{mod.__name__}.maybe_move_tensor_to_cpu"] = mod.maybe_move_tensor_to_cpu
        mod.maybe_move_tensor_to_cpu = _cpu_move_tensor


# -- 6. recomputation's RNG ------------------------------------------------------------
def _patch_recompute_rng() -> None:
    from megatron.core.tensor_parallel import random as mp_random  # megatron: patched here

    for name, value in (("_get_cuda_rng_state", lambda *a, **k: None),
                        ("_set_cuda_rng_state", lambda *a, **k: None)):
        ORIGINALS[f"{mp_random.__name__}.{name}"] = getattr(mp_random, name)
        setattr(mp_random, name, value)


def apply_cpu_patches() -> bool:
    """Apply every CPU adaptation once; returns True when they are active.

    No-op (returns False) on a machine with CUDA. Safe to call repeatedly:
    later calls change nothing (the patched objects stay the same objects).
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    block_broken_transformer_engine()
    # megatron announces each torch fallback at import; on CPU they are the expected path
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed.*")
    _patch_current_device()
    _patch_device_strings()
    _patch_type_asserts()
    _patch_moe()
    _patch_recompute_rng()
    _APPLIED = True
    return True


def cpu_patches_applied() -> bool:
    return _APPLIED
