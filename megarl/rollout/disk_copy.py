"""The broadcast publisher's disk copy of a published version, written in a background thread.

Engines take a version from the broadcast; the copy on disk (``weights/v{v}``)
is for what comes later: an engine restarted after the publish loads it, a
broadcast that fails falls back to it, and a checkpoint links it as the
engines' weights. So it is written beside the publish, not inside it: the
writer starts once the export is packed into the shared buckets the sender
broadcasts from, and reads those same buckets (no second copy of the model).

The copy appears in one rename: it is written into ``.v{v}.partial`` and
renamed to ``v{v}`` when complete, so a reader finds a complete version or
none. Whoever reads it first waits for the writer (:meth:`DiskCopy.wait`):
the publisher's disk fallback, the supervisor before it reloads a restarted
engine, the checkpoint before it links the copy, and the next ``prepare``
(which keeps host memory at one copy of the model). A failed write is raised
by every wait.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

from megarl.models.bridge import write_hf_checkpoint
from megarl.rollout.weight_sync import unpack


def buckets_as_tensors(buckets: list) -> dict[str, torch.Tensor]:
    """The named tensors of packed buckets ``(meta rows, meta bytes, payload)``: views into the payloads."""
    return {name: t for rows, _, payload in buckets for name, t in unpack(rows, payload)}


class DiskCopy:
    """One version's copy at a time, in a thread of its own (module doc)."""

    def __init__(self, write: Callable[[dict, Path, dict], object] = write_hf_checkpoint) -> None:
        #: ``write(tensors, out_dir, hf_config)``: what writes a version's directory
        self.write = write
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.version: int | None = None

    def start(self, out: Path, buckets: list, hf: dict, version: int) -> None:
        """Write ``buckets`` as ``out`` (a ``v{version}`` directory) in the background; the previous write
        must be done (:meth:`wait`)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"disk copy of version {self.version} still being written")
        self._error, self.version = None, version
        self._thread = threading.Thread(target=self._run, args=(Path(out), buckets, hf),
                                        name=f"megarl-disk-copy-v{version}", daemon=True)
        self._thread.start()

    def _run(self, out: Path, buckets: list, hf: dict) -> None:
        partial = out.with_name(f".{out.name}.partial")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            self.write(buckets_as_tensors(buckets), partial, hf)
            shutil.rmtree(out, ignore_errors=True)  # a version published again (a resumed run): the new copy
            os.replace(partial, out)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
            self._error = e
            shutil.rmtree(partial, ignore_errors=True)

    def join(self) -> None:
        """Let a write in progress finish (its failure is not raised here)."""
        if self._thread is not None:
            self._thread.join()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_sync(self) -> None:
        """Block until the copy is on disk; raise the writer's failure."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the disk copy of version {self.version} failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error

    async def wait(self) -> None:
        """:meth:`wait_sync` off the event loop."""
        if self.busy():
            await asyncio.to_thread(self._thread.join)
        self.wait_sync()
