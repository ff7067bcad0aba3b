"""The trainer interfaces: what the loop drives, and what a recovery strategy scores with.

:class:`TrainerProtocol` is the trainer as the controller, the publishers and
the checkpointer see it: :class:`~megarl.trainer.megatron_trainer.MegatronTrainer`
with one rank, :class:`~megarl.loop.spmd.DrivingTrainer` (rank 0 announcing
every collective to the other ranks) with several. :class:`ScoringTrainer` is
what a recovery strategy runs on its own rank's trainer (``RecoveryContext.trainer``,
recovery/base.py): forwards and parameter swaps. MegatronTrainer is both; the
driving view is never a ScoringTrainer, its followers would not join such a call.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch only for the annotations: this module stays light
    import torch

    from megarl.types import TrainBatch


@runtime_checkable
class TrainerProtocol(Protocol):
    """The policy trainer as the loop drives it."""

    #: optimizer steps taken: the policy version of the current parameters
    version: int
    #: why the last ``train_step`` applied no optimizer step ("non-finite loss", ...), None if it did
    last_skip_reason: str | None

    def train_step(self, batch: TrainBatch, loss_fn: Callable[..., Any]) -> dict[str, float]:
        """One optimizer step on ``batch`` (``skipped`` = 1.0 in the metrics when none was applied)."""

    def export_hf_weights(self, *, to_host: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight; a collective: consume it to the end.
        ``to_host=False``: left where the model is, uncopied."""

    def exported_hf_config(self) -> dict:
        """config.json of the exported weights (their dtype included)."""

    def save_hf_checkpoint(self, out_dir: str) -> Any:
        """An HF checkpoint of the current weights in ``out_dir`` (rank 0 writes)."""


@runtime_checkable
class ScoringTrainer(Protocol):
    """The local trainer a recovery strategy runs forwards with (``RecoveryContext.trainer``)."""

    #: optimizer steps taken: the policy version of the current parameters
    version: int
    #: "float32" or "bfloat16": the parameters' dtype (a scorer of old versions must use the same)
    dtype: str
    #: log-probs are of softmax(logits / temperature), the engines' sampling temperature
    temperature: float

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L-1] log-probs of ``batch``'s tokens under the current parameters (no grad)."""

    def get_params(self, device: str | torch.device | None = "cpu") -> dict[str, torch.Tensor]:
        """Detached copies of this rank's parameters on ``device`` (None: where the parameters are)."""

    def keep_params(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A host copy of this rank's parameters (or of ``params``) to keep across steps (reused buffers; on
        CUDA still being copied when it returns: read it on the host only after :meth:`params_ready`)."""

    def release_params(self, params: dict[str, torch.Tensor]) -> None:
        """Give a :meth:`keep_params` copy back (its buffers serve the next one)."""

    def params_ready(self) -> None:
        """Wait until every :meth:`keep_params` copy is complete."""

    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        """Load ``params`` (as from :meth:`get_params`)."""

    def use_params(self, params: dict[str, torch.Tensor],
                   saved: dict[str, torch.Tensor] | None = None) -> AbstractContextManager:
        """Score with ``params`` inside the block; the trainer's own parameters come back afterwards (from
        ``saved`` when the caller already holds a copy of them: no second copy is taken). ``params`` on the
        parameters' device in their dtype are pointed at, not copied."""

    def use_params_from(self, make: Callable[[str, torch.Tensor], torch.Tensor], *,
                        resident: bool = False) -> AbstractContextManager:
        """Score inside the block with ``make(name, p)`` in place of each parameter ``p`` (made on its device from
        the current values); the current ones are saved on the host and come back afterwards. ``resident``: the
        made tensors live on past the block on the parameters' device, in their dtype, and are pointed at:
        nothing is saved or copied."""

    def save_hf_checkpoint(self, out_dir: str) -> Any:
        """An HF checkpoint of the current weights in ``out_dir`` (a scorer process loads versions from it)."""
