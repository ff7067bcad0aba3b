"""Writing megatron-core ``torch_dist`` checkpoints in this process, now or in the background.

megatron-core 0.16.1's own ``torch_dist`` writer (``FileSystemWriterAsync``), even when used
synchronously, starts a ``spawn`` multiprocessing manager, which re-imports the main script in a new
interpreter, and forks a writer process per file. Under torchrun with a script that is not guarded by
``if __name__ == "__main__"`` that new interpreter builds a second trainer and waits in ``new_group``
for ranks that never come, and the save waits on it for ever. Here the same format is written with
``torch.distributed.checkpoint``'s plain ``FileSystemWriter`` in the calling thread.

A save has two parts (:func:`save_sharded`):

- **prepare**, at the call, a collective on the default group: megatron's ``dist_checkpointing.save``
  applies the factories, checks that every shard is saved exactly once, writes ``common.pt``, and hands
  the sharded tensors to :class:`InProcessTorchDistSave`, which returns a :class:`ShardedWrite` instead of
  writing. With ``background=True`` each tensor is first copied to host memory (this rank's shards of
  the state, held until the write ends: the copy is the part of a background save the caller waits for);
  else the write reads the live tensors.
- **write** (:meth:`ShardedWrite.run`): ``torch.distributed.checkpoint`` writes the shards, rank 0 writes
  megatron's ``metadata.json`` (the mark of a complete torch_dist directory), and the ranks meet in a
  barrier. In the background it runs on its own thread over :func:`checkpoint_group`, a gloo group
  used only by checkpoint writes, so its collectives never interleave with the trainer's on the default
  group; every rank must run its writes in the same order (one at a time).

The write is parallel where megatron allows it: a tensor replicated over ranks (the weights over DP) is
written by one of its holders, spread evenly over them by megatron's ``FullyParallelSaveStrategyWrapper``
(metadata only is exchanged, at the prepare), instead of always by its replica 0; and each rank writes
:data:`WRITE_THREADS` files side by side (``FileSystemWriter``'s ``thread_count``). What exists on one rank
only (the distributed optimizer's gathered state, megarl/trainer/dist_state.py) is written by that rank.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from megarl.trainer.parallel import collective_timeout

_GROUP = None
#: files each rank writes side by side (torch.distributed.checkpoint's FileSystemWriter thread_count)
WRITE_THREADS = 4


def checkpoint_group():
    """The gloo group of background checkpoint writes (made on first use: a collective of every rank)."""
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.new_group(backend="gloo", timeout=collective_timeout())  # trainer.collective_timeout_s
    return _GROUP


@contextlib.contextmanager
def quiet_upstream():
    """Hide the FutureWarnings megatron's torch_dist loader and torch's planner print on every load (deprecations
    of their own internals: nothing a user can act on)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch)\.")
        yield


class ShardedWrite:
    """The tensor part of one torch_dist save, prepared and not yet written (module doc)."""

    def __init__(self, state_dict: dict, checkpoint_dir: str, backend: str, version: int) -> None:
        self.state_dict = state_dict
        self.checkpoint_dir = checkpoint_dir
        self.backend, self.version = backend, version
        #: megatron appends its own finalizer (metadata.json, then a barrier on the default group); run() does
        #: the same on the group it is given instead
        self.finalize_fns: list = []

    def run(self, group=None) -> None:
        import torch.distributed.checkpoint as dcp
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

        dcp.save(self.state_dict, storage_writer=dcp.FileSystemWriter(self.checkpoint_dir,
                                                                       thread_count=WRITE_THREADS),
                 planner=MCoreSavePlanner(can_run_decentralized_global_plan=False, flatten_state_dict=False),
                 process_group=group)
        if dist.get_rank(group) == 0:
            save_config(CheckpointingConfig(self.backend, self.version), self.checkpoint_dir)
        dist.barrier(group=group)
        self.state_dict = None  # the host copies go with the write


def _strategy(to_host: bool):
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        """megatron's ``torch_dist`` format, prepared for :class:`ShardedWrite` (module doc)."""

        def async_save(self, sharded_state_dict, checkpoint_dir):
            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            if to_host:
                for shards in by_key.values():
                    for sh in shards:
                        if torch.is_tensor(sh.data):
                            sh.data = sh.data.detach().to("cpu", copy=True)
            return ShardedWrite(mcore_to_pyt_state_dict(by_key, False), str(checkpoint_dir), self.backend,
                                self.version)

        def save(self, sharded_state_dict, checkpoint_dir):
            self.async_save(sharded_state_dict, checkpoint_dir).run()

    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(InProcessTorchDistSave("torch_dist", 1, thread_count=WRITE_THREADS))


def save_sharded(sharded_state_dict: dict, checkpoint_dir: str, *, background: bool) -> ShardedWrite:
    """Prepare the save of ``sharded_state_dict`` into ``checkpoint_dir`` (an empty directory) and return its write
    (module doc); a collective of every rank. Run it now (``.run()``) or, with ``background=True``, on a thread
    (``.run(checkpoint_group())``)."""
    from megatron.core import dist_checkpointing

    if background:
        checkpoint_group()  # made here, where every rank is, not on a writer thread
    return dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=_strategy(background),
                                   async_sharded_save=True)
