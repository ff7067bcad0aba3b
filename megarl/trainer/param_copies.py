"""Copies of a trainer rank's parameters: what the recovery strategies keep and swap in for a forward.

A mixin of :class:`~megarl.trainer.megatron_trainer.MegatronTrainer` (it needs ``_module()``, the model
chunk whose ``named_parameters`` are this rank's local shards, and ``optimizer``). The copies are of the
weights the forward uses, in their own dtype: bf16 under bf16 (not the optimizer's fp32 main parameters),
exact at half an fp32 copy's bytes.
"""
from __future__ import annotations

import contextlib

import torch

from megarl.errors import InputError


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

    @torch.no_grad()
    def _copy_in(self, params: dict[str, torch.Tensor]) -> None:
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
    def use_params(self, params: dict[str, torch.Tensor]):
        """Score with ``params`` inside the block; the model's own parameters come back afterwards (saved where
        ``params`` are: on the device for a copy kept there, so the swap moves nothing over PCIe)."""
        first = next(iter(params.values()), None)
        here = first is not None and first.device == next(self._module().parameters()).device
        saved = self.get_params(device=None if here else "cpu")
        self._copy_in(params)
        try:
            yield self
        finally:
            self._copy_in(saved)
