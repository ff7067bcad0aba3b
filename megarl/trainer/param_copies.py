"""Copies of a trainer rank's parameters: what the recovery strategies keep and swap in for a forward.

A mixin of :class:`~megarl.trainer.megatron_trainer.MegatronTrainer` (it needs ``_module()``, the model
chunk whose ``named_parameters`` are this rank's local shards, and ``optimizer``). The copies are of the
weights the forward uses, in their own dtype: bf16 under bf16 (not the optimizer's fp32 main parameters),
exact at half an fp32 copy's bytes. :meth:`ParamCopies.get_params` copies now, into new tensors;
:meth:`ParamCopies.keep_params` is for copies a strategy keeps across steps: reused host buffers, filled on
a side stream on CUDA (megarl/trainer/host_copies.py), so every write of the parameters goes through
:meth:`ParamCopies.before_param_write` first.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from megarl.errors import InputError
from megarl.trainer.host_copies import HostCopyPool


class ParamCopies:
    """get_params / set_params / use_params over ``self._module()`` (module doc)."""

    def get_params(self, device: str | torch.device | None = "cpu") -> dict[str, torch.Tensor]:
        """Detached copies of this rank's local parameters (megatron names), in their own dtype, on ``device``
        (None: where the parameters are).

        The weights the forward uses (bf16 ones under bf16, not the optimizer's fp32 main parameters): a
        bf16 copy is exact at half an fp32 one's bytes.
        """
        return {n: p.detach().to(p.device if device is None else device, copy=True)
                for n, p in self._module().named_parameters()}

    def _host_copies(self) -> HostCopyPool:
        if getattr(self, "_host_copy_pool", None) is None:
            self._host_copy_pool = HostCopyPool()
        return self._host_copy_pool

    def keep_params(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A host copy of this rank's parameters (or of ``params``, as a checkpoint restored them) to keep
        across steps (module doc), pinned where CUDA is; give it back with :meth:`release_params` when it is no
        longer needed, read it on the host after :meth:`params_ready`."""
        if params is not None:
            return self._host_copies().copy(params.items(), pin=torch.cuda.is_available())
        return self._host_copies().copy(self._module().named_parameters())

    def release_params(self, params: dict[str, torch.Tensor]) -> None:
        """Return a :meth:`keep_params` copy's buffers for the next one."""
        self._host_copies().release(params)

    def params_ready(self) -> None:
        """Wait until every :meth:`keep_params` copy is complete (before reading one on the host)."""
        self._host_copies().ready()

    def before_param_write(self) -> None:
        """Every write of the parameters (optimizer step, swap, load) first waits, on the device, for the
        kept copies still being taken."""
        self._host_copies().before_write()

    @torch.no_grad()
    def _copy_in(self, params: dict[str, torch.Tensor]) -> None:
        self.before_param_write()
        own = dict(self._module().named_parameters())
        if set(own) != set(params):
            raise InputError(f"params do not match the model: missing {sorted(set(own) - set(params))[:3]}, "
                             f"unexpected {sorted(set(params) - set(own))[:3]}")
        for n, p in own.items():
            p.copy_(params[n])

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        """Load ``params`` (as from :meth:`get_params`) into the model and the optimizer's master copies.

        Under bf16 the model rounds them to bf16 and the fp32 main parameters are set to those
        rounded values (megatron's ``reload_model_params``).
        """
        self._copy_in(params)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()  # no-op for fp32 params (no separate master copy)

    @contextlib.contextmanager
    def use_params_from(self, make: Callable[[str, torch.Tensor], torch.Tensor], *, resident: bool = False):
        """Score inside the block with parameters made on the device, tensor by tensor, from the current ones:
        ``make(name, p)`` returns the values for ``p`` (on its device, read before ``p`` is overwritten). The
        current ones are saved on the host first and come back afterwards (ewma folds its host phi this way,
        recovery/ewma.py).

        ``resident``: the tensors ``make`` returns live on past the block, on the parameters' device and in
        their dtype (ewma's phi kept on the GPU): the parameters point at them inside the block and at their
        own tensors again afterwards; nothing is copied or saved (:func:`pointed_at`)."""
        named = list(self._module().named_parameters())
        if resident:
            with pointed_at_made(named, make):
                yield self
            return
        self.before_param_write()
        saved = {}
        with torch.no_grad():
            for n, p in named:
                saved[n] = p.detach().to("cpu", copy=True)
                p.copy_(make(n, p.detach()))
        try:
            yield self
        finally:
            self._copy_in(saved)

    @contextlib.contextmanager
    def use_params(self, params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor] | None = None):
        """Score with ``params`` inside the block; the model's own parameters come back afterwards.

        ``params`` on the parameters' device and in their dtype (a copy kept there): the parameters point at
        them inside the block (:func:`pointed_at`), no copy is taken and nothing moves. Otherwise they are
        copied in and the model's own come back from ``saved``, a copy of them the caller already holds, else
        from a host copy taken here."""
        named = list(self._module().named_parameters())
        if resident_match(named, params):
            with pointed_at(named, params):
                yield self
            return
        saved = self.get_params() if saved is None else saved
        self._copy_in(params)
        try:
            yield self
        finally:
            self._copy_in(saved)


def _mismatch(named: list[tuple[str, torch.nn.Parameter]], params: dict[str, torch.Tensor]) -> str | None:
    """The first parameter ``params`` has no tensor for on its device, in its dtype and shape (None: none), or
    the first name of ``params`` the model does not have."""
    for n, p in named:
        t = params.get(n)
        if t is None or t.device != p.device or t.dtype != p.dtype or t.shape != p.shape:
            return n
    extra = set(params) - {n for n, _ in named}
    return min(extra) if extra else None


def resident_match(named: list[tuple[str, torch.nn.Parameter]], params: dict[str, torch.Tensor]) -> bool:
    """Whether ``params`` hold one tensor per parameter on its device, in its dtype and shape."""
    return _mismatch(named, params) is None


@contextlib.contextmanager
def pointed_at(named: list[tuple[str, torch.nn.Parameter]], params: dict[str, torch.Tensor]):
    """Inside the block each parameter's data is the tensor of ``params`` of its name; its own tensor (a view of
    megatron's contiguous parameter buffer, say) comes back afterwards, untouched: nothing is copied, and a
    copy of the parameters still being taken from that tensor (megarl/trainer/host_copies.py) goes on."""
    bad = _mismatch(named, params)
    if bad is not None:
        raise InputError(f"parameter {bad!r}: the tensor to point it at must have its device, dtype and shape")
    own = [(p, p.data) for _, p in named]
    try:
        for n, p in named:
            p.data = params[n]
        yield
    finally:
        for p, data in own:
            p.data = data


@contextlib.contextmanager
def pointed_at_made(named: list[tuple[str, torch.nn.Parameter]], make: Callable[[str, torch.Tensor], torch.Tensor]):
    """:func:`pointed_at` the tensors ``make(name, p)`` returns for each parameter (made without autograd from
    its current values; ``use_params_from(resident=True)``)."""
    with torch.no_grad():
        made = {n: make(n, p.detach()) for n, p in named}
    with pointed_at(named, made):
        yield
