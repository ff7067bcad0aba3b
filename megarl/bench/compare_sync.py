"""`megarl bench --compare-sync`: asynchronous (eta) against synchronous (eta 0) training, on shared and on
disjoint cores.

Four runs of behav from the same config and seed: async and sync with the
trainer and the engines on every core, then both again with the trainer on
some cores and the engines on the others (``placement.cpu_affinity``,
megarl/platform/cpu_affinity.py). On shared cores the ratio mixes the design with
core contention (the trainer and the engines slow each other down); on
disjoint cores each role behaves like one on devices of its own, which is
what asynchrony is designed for. The report's ``async_vs_sync`` holds both
ratios (megarl/bench/report.py :func:`~megarl.bench.report.throughput`). With
``--repeats`` the async and sync runs alternate over the rounds, per core
layout, and each ratio gets its interval (megarl/bench/interleave.py).
"""
from __future__ import annotations

from megarl.errors import ConfigError
from megarl.platform.cpu_affinity import available_cores, check_cores, format_cores, parse_cores


def split_cores(spec: str | None, cores: set[int] | None = None) -> tuple[list[int], list[int]]:
    """(trainer cores, engine cores): ``spec`` as ``TRAINER:ENGINES`` (e.g. ``0:1`` or ``0-3:4-7``), or by
    default the available cores halved (the trainer takes the first half, at least one core)."""
    cores = available_cores() if cores is None else cores
    if spec:
        left, sep, right = spec.partition(":")
        if not sep or not left or not right:
            raise ConfigError(f"--disjoint-cores={spec!r}: write TRAINER:ENGINES, e.g. 0:1 or 0-3:4-7")
        trainer, engines = parse_cores(left, "--disjoint-cores"), parse_cores(right, "--disjoint-cores")
        check_cores(trainer, "--disjoint-cores (trainer)", cores)
        check_cores(engines, "--disjoint-cores (engines)", cores)
        if set(trainer) & set(engines):
            raise ConfigError(f"--disjoint-cores={spec!r}: core(s) {format_cores(set(trainer) & set(engines))} are "
                              f"given to both roles; the two lists must not overlap")
        return trainer, engines
    ordered = sorted(cores)
    if len(ordered) < 2:
        raise ConfigError(f"--compare-sync on disjoint cores needs at least 2 cores; this process may use "
                          f"{format_cores(ordered)}")
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def sync_runs(eta: int, trainer_cores: list[int], engine_cores: list[int]) -> list[tuple[str, str, list[str]]]:
    """(report key, run directory name, extra overrides) of the four runs, in the order they run."""
    if eta < 1:
        raise ConfigError(f"--compare-sync compares eta={eta} with eta=0; give an eta >= 1 (--eta or rollout.eta)")
    pin = [f"placement.cpu_affinity.trainer=[{','.join(map(str, trainer_cores))}]",
           f"placement.cpu_affinity.engines=[{','.join(map(str, engine_cores))}]"]
    return [("async", f"async_eta{eta}", [f"rollout.eta={eta}"]),
            ("sync", "sync_eta0", ["rollout.eta=0", "trainer.publish_every=1"]),
            ("async_disjoint", f"async_eta{eta}_disjoint", [f"rollout.eta={eta}", *pin]),
            ("sync_disjoint", "sync_eta0_disjoint", ["rollout.eta=0", "trainer.publish_every=1", *pin])]
