"""The disk publisher (``rollout.weight_sync=disk``): an HF checkpoint per version on (shared) disk, which
every engine loads (megarl/rollout/publish.py has the publishers' protocol)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from megarl.models.bridge import write_hf_checkpoint
from megarl.rollout.export_buckets import engine_weights, recorded_dtype


class DiskPublisher:
    """Weights to engines through safetensors on (shared) disk: export, then load."""

    def __init__(self, trainer, router, weights_dir: Path, *, engine_dtype: str | None = None) -> None:
        self.trainer = trainer
        self.router = router
        self.weights_dir = weights_dir
        self.engine_dtype = engine_dtype

    async def prepare(self, version: int) -> None:
        out = self.weights_dir / f"v{version}"
        if not self.engine_dtype or self.engine_dtype == recorded_dtype(self.trainer.exported_hf_config()):
            await asyncio.to_thread(self.trainer.save_hf_checkpoint, str(out))
            return
        tensors, hf = await asyncio.to_thread(engine_weights, self.trainer, self.engine_dtype)
        await asyncio.to_thread(write_hf_checkpoint, dict(tensors), out, hf)

    async def apply(self, version: int) -> dict:
        """Every engine loads ``version``; returns the step record's ``weight_sync_bytes`` and engine phases."""
        current = self.weights_dir / f"v{version}"
        phases = await self.router.update_weights_from_disk(str(current), version)
        remove_other_versions(self.weights_dir, current)
        return {"weight_sync_bytes": sum(f.stat().st_size for f in current.glob("*.safetensors")), **(phases or {})}

    async def wait_written(self) -> None:
        """The published version is on disk (here it is the transport: written before the engines load it)."""

    def close(self) -> None:
        pass


def remove_other_versions(weights_dir: Path, current: Path) -> None:
    for old in weights_dir.glob("v*"):
        if old != current:
            shutil.rmtree(old, ignore_errors=True)
