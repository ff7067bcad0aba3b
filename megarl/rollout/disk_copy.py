"""The broadcast publisher's disk copy of a published version, written in a background thread.

Engines take a version from the broadcast; the copy on disk (``weights/v{v}``)
is for what comes later: an engine restarted after the publish loads it, a
broadcast that fails falls back to it, and a checkpoint links it as the
engines' weights. So it is written beside the publish, not inside it: the
writer starts once the export is packed into the shared buckets the sender
broadcasts from, and reads those same buckets (no second copy of the model).

The copy appears in one rename: it is written into ``.v{v}.partial`` and
renamed to ``v{v}`` when complete, so a reader finds a complete version or
none. Whoever reads it waits for the writer of the version it reads
(:meth:`DiskCopy.wait`): the publisher's disk fallback, the supervisor before
it reloads a restarted engine, the checkpoint before it links the copy. A
failed write is raised by every wait for it.

A publish never waits for the disk. Only the newest published version's copy
is needed (what a restart loads and a checkpoint links), so the copies are
written one at a time, newest last: ``start`` of a version while an older one
is still being written queues it (a version queued before it and never
started is dropped), and :meth:`DiskCopy.supersede`, called once the new
version is published, stops the older write at its next piece
(megarl/models/safetensors_stream.py) and removes its partial directory; the
queued one starts at once. Until then the older write goes on: a restart
between the two publishes still loads the version the engines serve. Host
memory: the buckets of a version are held until its write ends, so a disk
slower than one train step holds two exports between the next ``prepare`` and
its ``apply``.
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
from megarl.models.safetensors_stream import WriteStopped
from megarl.rollout.bucket_format import unpack


def buckets_as_tensors(buckets: list) -> dict[str, torch.Tensor]:
    """The named tensors of packed buckets ``(meta rows, meta bytes, payload)``: views into the payloads."""
    return {name: t for rows, _, payload in buckets for name, t in unpack(rows, payload)}


class Superseded(Exception):
    """The copy of a version was stopped or dropped: a newer version is published (module doc)."""


class _Job:
    """One version's copy: where, from what, and how it ended."""

    def __init__(self, out: Path, buckets: list, hf: dict, version: int, on_end: Callable[[], None] | None) -> None:
        self.out, self.buckets, self.hf, self.version = Path(out), buckets, hf, version
        self.on_end = on_end
        self.stop = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def end(self, error: BaseException | None = None) -> None:
        self.error, self.buckets = error, None  # the buckets go with the write
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()  # nothing here reads the buckets any more
        self.done.set()


class DiskCopy:
    """The published versions' copies, one at a time, in a thread of their own (module doc)."""

    def __init__(self, write: Callable[..., object] = write_hf_checkpoint) -> None:
        #: ``write(tensors, out_dir, hf_config, should_stop=...)``: what writes a version's directory, stopping
        #: (raising) once ``should_stop()`` is true
        self.write = write
        self._lock = threading.Lock()
        self._running: _Job | None = None
        self._queued: _Job | None = None
        self._jobs: dict[int, _Job] = {}  # by version: the newest of each, for its readers
        self._thread: threading.Thread | None = None
        #: the newest version started or queued
        self.version: int | None = None
        #: copies stopped or dropped because a newer version was published
        self.n_superseded = 0

    def start(self, out: Path, buckets: list, hf: dict, version: int,
              on_end: Callable[[], None] | None = None) -> None:
        """Write ``buckets`` as ``out`` (a ``v{version}`` directory) in the background, after the write in
        progress if there is one (module doc); ``on_end()`` once the buckets are no longer read (the write
        ended: written, failed, stopped or dropped)."""
        job = _Job(out, buckets, hf, version, on_end)
        with self._lock:
            if self._queued is not None:  # never started, and now older than the newest
                self._drop(self._queued)
            self._jobs[version], self.version = job, version
            if self._running is None:
                self._running = job
                self._thread = threading.Thread(target=self._loop, name="megarl-disk-copy", daemon=True)
                self._thread.start()
            else:
                self._queued = job

    def supersede(self, version: int) -> None:
        """``version`` is published: stop a write of an older version (the queued one starts next)."""
        with self._lock:
            running = self._running
            if running is not None and running.version < version:
                running.stop.set()

    async def settled_before(self, version: int) -> None:
        """Every write of a version older than ``version`` has ended (written, failed or stopped); their
        records are forgotten."""
        with self._lock:
            older = [j for v, j in self._jobs.items() if v < version]
        for job in older:
            if not job.done.is_set():
                await asyncio.to_thread(job.done.wait)
        with self._lock:
            for job in older:
                if self._jobs.get(job.version) is job:
                    del self._jobs[job.version]

    def _drop(self, job: _Job) -> None:
        self.n_superseded += 1
        job.end(Superseded(f"the disk copy of version {job.version} was dropped: a newer version is published"))

    def _loop(self) -> None:
        job = self._running
        while job is not None:
            self._run(job)
            with self._lock:
                job, self._queued = self._queued, None
                self._running = job

    def _run(self, job: _Job) -> None:
        partial = job.out.with_name(f".{job.out.name}.partial")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            self.write(buckets_as_tensors(job.buckets), partial, job.hf, should_stop=job.stop.is_set)
            if job.stop.is_set():
                raise WriteStopped("stopped after the last piece")
            shutil.rmtree(job.out, ignore_errors=True)  # a version published again (a resumed run): the new copy
            os.replace(partial, job.out)
        except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
            shutil.rmtree(partial, ignore_errors=True)
            stopped = job.stop.is_set()
            self.n_superseded += stopped
            job.end(Superseded(f"the disk copy of version {job.version} was stopped: a newer version is "
                               f"published") if stopped else e)
            return
        job.end()

    def join(self) -> None:
        """Let the writes in progress and queued finish (their failures are not raised here)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def _job(self, version: int | None) -> _Job | None:
        with self._lock:
            return self._jobs.get(self.version if version is None else version)

    @staticmethod
    def _outcome(job: _Job) -> None:
        if job.error is not None:
            raise RuntimeError(f"writing the disk copy of version {job.version} failed: "
                               f"{type(job.error).__name__}: {job.error}") from job.error

    def wait_sync(self, version: int | None = None) -> None:
        """Block until the copy of ``version`` (default: the newest started) is on disk; raise its writer's
        failure (:class:`Superseded` when a newer version took its place)."""
        job = self._job(version)
        if job is not None:
            job.done.wait()
            self._outcome(job)

    async def wait(self, version: int | None = None) -> None:
        """:meth:`wait_sync` off the event loop (the job is looked up once: a version started meanwhile is not
        waited for)."""
        job = self._job(version)
        if job is not None:
            if not job.done.is_set():
                await asyncio.to_thread(job.done.wait)
            self._outcome(job)
