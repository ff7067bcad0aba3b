"""snapshot (exact): keep the parameters of every version a live token still references.

At ``on_weights_published(v)`` the trainer's parameters are version v (the loop
publishes right after an optimizer step), so a copy is taken then: in CPU
memory (``trainer.keep_params``: the buffers of a freed version serve the next
one, pinned when CUDA is present, and the copy runs beside the trainer's next
work until the next optimizer step; megarl/trainer/host_copies.py) or as
safetensors under ``<run_dir>/snapshots``. A version is freed as soon as no live token references
it and it is not the version the engines generate with (garbage collection
after every publish and after every train batch), so at most eta+1 versions are
held.

``anchor`` runs one forward per distinct version present in the batch, over
only the rows holding that version, and fills only the positions of that
version: a spliced sequence (tokens 1..4 by v7, 5..10 by v8) is scored once per
segment version. The trainer's current version is scored with the current
parameters, without a swap. A swap to another version restores the current
parameters afterwards from their kept copy where one is held (storage=cpu,
the current version published: the loop publishes every step by default), so
it moves two shards host-to-device and takes no copy of the current ones;
otherwise it takes that copy first (one more shard device-to-host).

Overhead keys: recovery_s, snapshot_save_s, snapshot_load_s, bytes_held (bytes
of kept copies, in memory or on disk), bytes_moved (disk I/O), versions_held,
extra_param_copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from megarl.trainer.parallel import global_rank
from megarl.types import AnchorResult, TrainBatch, Trajectory
from recovery._scoring import params_nbytes, score_versions, versions_in
from recovery.base import RecoveryStrategy
from recovery.registry import register


@dataclass
class SnapshotConfig:
    """Options of the snapshot strategy."""

    storage: Literal["cpu", "disk"] = "cpu"
    """Where kept versions live: cpu (host memory, pinned when CUDA is present) or disk (safetensors under <run_dir>/snapshots)."""


@register
class Snapshot(RecoveryStrategy):
    name = "snapshot"
    Config = SnapshotConfig
    exact = True
    uses_live_trajectories = False  # live versions only

    def __init__(self, cfg: SnapshotConfig, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        #: version -> its parameters (storage=cpu) or the path of its safetensors file (storage=disk)
        self._held: dict[int, Any] = {}
        self._nbytes: dict[int, int] = {}
        #: the version the engines generate with (kept even before any token references it)
        self._published: int | None = None

    # -- storage -----------------------------------------------------------------
    def _dir(self) -> Path:
        if not self.ctx.run_dir:
            raise RuntimeError("recovery.snapshot.storage=disk needs a run directory (RecoveryContext.run_dir)")
        d = Path(self.ctx.run_dir) / "snapshots"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _store(self, version: int, params: dict[str, torch.Tensor]) -> None:
        nbytes = params_nbytes(params)
        with self.meter.time("snapshot_save_s"):
            if self.cfg.storage == "disk":
                self.ctx.trainer.params_ready()
                path = self._dir() / f"v{version}.rank{global_rank()}.safetensors"
                save_file({k: t.contiguous() for k, t in params.items()}, str(path))
                self.ctx.trainer.release_params(params)  # its buffer takes the next version's copy
                self._held[version] = str(path)
                self.meter.add("bytes_moved", nbytes)
            else:
                if torch.cuda.is_available() and not all(t.is_pinned() for t in params.values()):
                    params = self.ctx.trainer.keep_params(params)  # a restored version: one pinned buffer as well
                self._held[version] = params
        self._nbytes[version] = nbytes

    def params(self, version: int) -> dict[str, torch.Tensor]:
        """The kept parameters of ``version`` (read from disk with storage=disk); KeyError if not held."""
        return self._load(version)

    def _load(self, version: int) -> dict[str, torch.Tensor]:
        held = self._held[version]
        if self.cfg.storage != "disk":
            return held
        with self.meter.time("snapshot_load_s"):
            params = load_file(held)
        self.meter.add("bytes_moved", self._nbytes[version])
        return params

    def _free(self, version: int) -> None:
        held = self._held.pop(version)
        self._nbytes.pop(version)
        if self.cfg.storage == "disk":
            Path(held).unlink(missing_ok=True)
        else:
            self.ctx.trainer.release_params(held)  # its buffers take the next kept version

    def _collect_garbage(self) -> None:
        keep = set(self.ctx.live_versions())
        if self._published is not None:
            keep.add(self._published)
        for v in [v for v in self._held if v not in keep]:
            self._free(v)
        self._report()

    def _report(self) -> None:
        self.meter.set("bytes_held", float(sum(self._nbytes.values())))
        self.meter.set("versions_held", float(len(self._held)))
        self.meter.set("extra_param_copies", float(len(self._held)))

    @property
    def held_versions(self) -> list[int]:
        return sorted(self._held)

    # -- hooks -------------------------------------------------------------------
    def on_weights_published(self, version: int) -> None:
        trainer = self.ctx.trainer
        if trainer.version != version:
            raise RuntimeError(f"snapshot: weights of version {version} published while the trainer is at "
                               f"version {trainer.version}; the loop must publish right after the optimizer step "
                               f"that produced them")
        self._published = version
        if version not in self._held:
            self._store(version, trainer.keep_params())
        self._collect_garbage()

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        self._collect_garbage()

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        trainer = self.ctx.trainer
        current = trainer.version
        with self.meter.time("recovery_s"):
            needed = versions_in(batch)
            missing = [v for v in needed if v != current and v not in self._held]
            if missing:
                raise RuntimeError(f"snapshot: batch has tokens of versions {missing} but only "
                                   f"{self.held_versions} (and the current {current}) are held; a version was freed "
                                   f"while a live token referenced it (RecoveryContext.live_versions incomplete?)")
            # a swap restores the current parameters from their kept copy when there is one (the version
            # published right after the last step): no copy of them is taken per swap (module doc)
            saved = self._held.get(current) if self.cfg.storage == "cpu" else None
            if saved is not None and any(v != current for v in needed):
                trainer.params_ready()  # that copy may still be being taken beside the trainer's work
            logp_old = score_versions(batch, trainer, lambda v: None if v == current else self._load(v),
                                      saved=saved)
        self._report()
        return AnchorResult(logp_anchor=logp_old, exact=True,
                            metrics={"recovery/forwards": float(len(needed))})

    def overhead(self) -> dict[str, float]:
        self._report()
        return super().overhead()

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Self-contained: the parameters of every held version (read back from disk if stored there)."""
        self.ctx.trainer.params_ready()
        return {"published": self._published,
                "versions": {v: {k: t.clone() for k, t in self._load(v).items()} for v in self.held_versions}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for v in list(self._held):
            self._free(v)
        self._published = state["published"]
        for v, params in sorted(state["versions"].items()):
            self._store(int(v), params)
        self._report()

    def close(self) -> None:
        for v in list(self._held):
            self._free(v)
