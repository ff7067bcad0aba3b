"""`megarl bench` orchestration: real training runs per strategy, interleaved and repeated, then the report.

Every strategy runs from the same config and seed, its runs interleaved with the
other strategies' and repeated (megarl/bench/interleave.py), each in
its own fresh Python process (``python -m megarl.bench.run SPEC``) so that its
peak memory is its own: the parent samples the resident set of that process
and all its descendants (reward workers, the dedicated scorer) and of the
engines. The engines are the parent's (megarl/rollout/engine_pool.py): started
once for all the runs whose engine settings agree, each run connects to them
and resets them to the base checkpoint first.

Inside the child the strategy is wrapped in :class:`BenchStrategy`, a
:class:`~recovery.verifier.VerifyingStrategy` that also times every hook. The
verifier's own work (the true-``logp_old`` forwards inside ``anchor`` and the
parameter copies it keeps at each publish) is reported per step under
``recovery/bench_verifier_anchor_s`` and ``recovery/bench_verifier_publish_s``
and subtracted by :mod:`megarl.bench.report` from ``recovery_s``, ``step_s``,
``wall_s`` and ``gen_stall_total_s``. The subtraction is first order: while
the verifier runs, the engines keep generating, so later steps may wait a
little less for their batch than they would without it.

The strategy's own hook time outside ``anchor`` and ``before_publish``, which
the loop does not time separately, is reported as
``recovery/bench_hook_publish_s`` (``on_weights_published`` inside a publish,
e.g. snapshot's copy or dedicated's checkpoint write) and
``recovery/bench_hook_optimizer_s`` (``after_optimizer_step``, e.g. ewma's
average update).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # without it the peak memory is taken from getrusage (_TreeRssSampler.available)
    psutil = None

from megarl.bench import interleave, plots, replay_cost, replay_engine_cost, report, report_render, round_reports
from megarl.bench.compare_sync import split_cores, sync_runs
from megarl.builder import VerifyingStrategy, load_run_config
from megarl.config import MegaRLConfig
from megarl.errors import MegarlError
from megarl.platform.cpu_affinity import available_cores, format_cores
from megarl.preflight import ensure_checkpoint
from megarl.rollout.engine_key import ENGINE_KEY_ENV
from megarl.rollout.engine_pool import ConnectedEngines, EnginePool
from megarl.train import train
from megarl.types import NO_VERSION, AnchorResult, TrainBatch, Trajectory

#: seconds between two samples of the process tree's resident memory
RSS_SAMPLE_INTERVAL_S = 0.5


class BenchStrategy(VerifyingStrategy):
    """VerifyingStrategy that reports the time of the verifier and of the inner hooks.

    With ``verify=False`` no truth is computed and no parameters are kept;
    only the hook timings remain.
    """

    name = "bench"

    def __init__(self, inner: Any, verify: bool = True) -> None:
        super().__init__(inner)
        self.verify = verify
        self._in_loop = False  # the first publish (version 0) happens before the timed loop

    def anchor(self, batch: TrainBatch, trajs: list[Trajectory]) -> AnchorResult:
        self._count_batch(batch)
        t0 = time.perf_counter()
        if self.verify:
            result = super().anchor(batch, trajs)
        else:
            result = self.inner.anchor(batch, trajs)
            self.inner_anchor_s = time.perf_counter() - t0
        self.meter.add("bench_verifier_anchor_s", time.perf_counter() - t0 - self.inner_anchor_s)
        return result

    def _count_batch(self, batch: TrainBatch) -> None:
        """What a forward over this batch processes (for the cost model, megarl/launch/cost.py):
        ``bench_seq_tokens`` (prompt + response tokens), ``bench_version_rows`` (rows x distinct policy
        versions in the row) and ``bench_version_seq_tokens`` (the tokens of one forward per version over
        only the rows holding it, as snapshot scores a batch)."""
        policy = (batch.loss_mask != 0) & (batch.versions != NO_VERSION)
        n_versions = [len(set(batch.versions[b][policy[b]].tolist())) for b in range(batch.size)]
        lens = [int(n) for n in batch.seq_lens]
        self.meter.add("bench_seq_tokens", float(sum(lens)))
        self.meter.add("bench_version_rows", float(sum(n_versions)))
        self.meter.add("bench_version_seq_tokens", float(sum(n * s for n, s in zip(n_versions, lens))))

    def on_weights_published(self, version: int) -> None:
        t0 = time.perf_counter()
        if self.verify:
            self.params_by_version[version] = self.ctx.trainer.get_params()
            # versions no live token references can never be asked for again
            oldest_live = min(self.ctx.live_versions() | {version})
            for v in [v for v in self.params_by_version if v < oldest_live]:
                del self.params_by_version[v]
        t1 = time.perf_counter()
        self.inner.on_weights_published(version)
        t2 = time.perf_counter()
        if self._in_loop:
            self.meter.add("bench_verifier_publish_s", t1 - t0)
            self.meter.add("bench_hook_publish_s", t2 - t1)
        self._in_loop = True

    def after_optimizer_step(self, version: int, metrics: dict[str, float]) -> None:
        with self.meter.time("bench_hook_optimizer_s"):
            self.inner.after_optimizer_step(version, metrics)

    def overhead(self) -> dict[str, float]:
        out = dict(self.inner.overhead())
        out.update(self.meter.pop_step())
        return out


# -- the child: one strategy, one train() ------------------------------------------------
def child_config(spec: dict[str, Any]) -> MegaRLConfig:
    """The run config the child trains with: the spec's config and overrides, its strategy and steps."""
    return load_run_config(spec["config"], [*spec["overrides"], f"recovery.name={spec['strategy']}",
                                            f"trainer.total_steps={spec['steps']}", "logging.progress=none",
                                            "logging.tensorboard=false", f"logging.output_dir={spec['run_dir']}"])


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["strategy"]`` for ``spec["steps"]`` steps into ``spec["run_dir"]``; returns the child summary."""
    run_dir = Path(spec["run_dir"])
    cfg = child_config(spec)
    wrapped: list[BenchStrategy] = []

    def wrap(inner):
        wrapped.append(BenchStrategy(inner, verify=spec["verify"]))
        return wrapped[-1]

    t0 = time.perf_counter()
    pool = ConnectedEngines(spec["engines"]) if spec.get("engines") else None
    train(cfg, wrap_strategy=wrap, engine_pool=pool)
    kib = 1024.0  # ru_maxrss is in KiB on Linux
    summary = {"strategy": spec["strategy"], "total_s": time.perf_counter() - t0,
               "verify": wrapped[-1].report() if spec["verify"] else None,
               "ru_maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib,
               "ru_maxrss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib,
               "trainer_cores": sorted(os.sched_getaffinity(0))}
    (run_dir / "bench_child.json").write_text(json.dumps(summary, default=_json_default) + "\n")
    return summary


def _json_default(x: Any) -> Any:
    return None if isinstance(x, float) else str(x)


# -- the parent: processes, memory, report ----------------------------------------------
class _TreeRssSampler(threading.Thread):
    """Peak of the summed RSS of processes and all their descendants (psutil; idle without it)."""

    def __init__(self, pid: int, extra_pids: list[int] = ()) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.extra_pids = list(extra_pids)
        self.peak_mb = 0.0
        self._stop_event = threading.Event()
        self._psutil = psutil

    @property
    def available(self) -> bool:
        return self._psutil is not None

    def run(self) -> None:
        if self._psutil is None:
            return
        ps = self._psutil
        try:
            root = ps.Process(self.pid)
            extra = [ps.Process(pid) for pid in self.extra_pids]  # the pooled engines: not the run's children
        except ps.Error:
            return
        while not self._stop_event.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
                for e in extra:
                    procs += [e, *e.children(recursive=True)]
            except ps.Error:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except ps.Error:
                    pass
            self.peak_mb = max(self.peak_mb, total / 2**20)
            self._stop_event.wait(RSS_SAMPLE_INTERVAL_S)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _prepare_run_dir(run_dir: Path) -> None:
    """Metrics files are appended to, so a previous bench run in ``run_dir`` is removed first (one stopped
    before train() wrote its config.yaml has at least the bench.log :func:`run_child` opens first)."""
    if run_dir.exists():
        if any(run_dir.iterdir()) and not any((run_dir / f).exists() for f in ("config.yaml", "bench.log")):
            raise MegarlError(f"{run_dir} exists and is not a previous bench run; choose another --output")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


def run_child(spec: dict[str, Any], pool: EnginePool | None = None) -> dict[str, Any]:
    """Run one strategy in a fresh process, on ``pool``'s engines (None: its own); adds ``peak_rss_mb``
    (process tree and engines) to its summary."""
    run_dir = Path(spec["run_dir"])
    _prepare_run_dir(run_dir)
    log_path = run_dir / "bench.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    engine_pids: list[int] = []
    if pool is not None:
        cfg = child_config(spec)
        spec = {**spec, "engines": pool.start(cfg, ensure_checkpoint(cfg))}
        env[ENGINE_KEY_ENV] = pool.key  # in the environment: a command line is readable by other users
        engine_pids = pool.pids()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megarl.bench.run", json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = _TreeRssSampler(proc.pid, engine_pids)
    sampler.start()
    try:
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    finally:
        sampler.stop()
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise MegarlError(f"bench run of {spec['strategy']!r} failed (exit code {rc}); log {log_path}:\n"
                          + "\n".join(tail))
    summary = json.loads((run_dir / "bench_child.json").read_text())
    if sampler.available:
        # sampled every RSS_SAMPLE_INTERVAL_S; the child's own exact peak is a floor
        summary["peak_rss_mb"] = max(sampler.peak_mb, summary["ru_maxrss_self_mb"])
        summary["peak_rss_method"] = "psutil tree sum"
    else:
        summary["peak_rss_mb"] = summary["ru_maxrss_self_mb"] + summary["ru_maxrss_children_mb"]
        summary["peak_rss_method"] = "getrusage self + largest child"
    return summary


def weights_nbytes(run_dir: Path) -> int:
    """Bytes of one published version: the HF safetensors the run wrote at the end (same layout as a publish)."""
    return sum(f.stat().st_size for f in (run_dir / "final").glob("*.safetensors"))


def run_strategy(spec: dict[str, Any], pool: EnginePool | None = None) -> dict[str, Any]:
    """:func:`run_child`, then the run's records: ``{"records", "child", "weights_nbytes"}``."""
    child = run_child(spec, pool)
    run_dir = Path(spec["run_dir"])
    return {"records": report.load_metrics(run_dir / "metrics.jsonl"), "child": child,
            "weights_nbytes": weights_nbytes(run_dir)}


def machine_meta() -> dict[str, Any]:
    """What the report says about the machine: CPUs this process may use, the load average now."""
    return {"cpu_count": len(available_cores()), "loadavg_start": os.getloadavg()[0]}


def bench(config: str, strategies: list[str], steps: int | None, output: str, overrides: list[str], *,
          compare_sync: bool = False, verify: bool = True, eta: int | None = None,
          disjoint_cores: str | None = None, repeats: int = interleave.DEFAULT_REPEATS,
          log=print) -> dict[str, Any]:
    """Run every strategy ``repeats`` times, interleaved (megarl/bench/interleave.py), and, with
    ``compare_sync``, async vs sync on shared and on disjoint cores; with ``rollout.routing_replay``, the
    replay's cost (megarl/bench/replay_cost.py); then write report.json, report.md and the plots. Repeat 1
    of a strategy runs in OUTPUT/NAME, repeat r > 1 in OUTPUT/repeats/NAME_r."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_run_config(config, overrides)  # fails fast on a bad config or override
    steps = steps or cfg.trainer.total_steps
    eta = cfg.rollout.eta if eta is None else eta
    planned = sync_runs(eta, *split_cores(disjoint_cores)) if compare_sync else []  # bad cores fail here
    meta = {"config": config, "overrides": overrides, "steps": steps, "eta": cfg.rollout.eta, "verify": verify,
            "repeats": repeats, "runs": interleave.describe(repeats), **machine_meta()}
    rounds: list[dict[str, dict[str, Any]]] = [{} for _ in range(repeats)]
    by_key: list[dict[str, list[dict]] | None] = [None] * repeats  # per round: --compare-sync runs
    with EnginePool(out / "engines") as pool:  # one set of engines for every run whose engine settings agree
        order = interleave.schedule(strategies, repeats)
        for i, (r, name) in enumerate(order, 1):
            log(f"[{i}/{len(order)}] {name}" + (f" (repeat {r + 1} of {repeats})" if repeats > 1 else "") + " ...")
            run_dir = out / name if r == 0 else out / "repeats" / f"{name}_{r + 1}"
            rounds[r][name] = run_strategy({"config": config, "overrides": overrides, "strategy": name,
                                            "steps": steps, "run_dir": str(run_dir), "verify": verify}, pool)
            child = rounds[r][name]["child"]
            log(f"      done in {child['total_s']:.0f} s, peak RSS {child['peak_rss_mb']:.0f} MB")
        if planned:
            trainer_cores, engine_cores = split_cores(disjoint_cores)
            meta["compare_sync"] = {"eta": eta, "trainer_cores": format_cores(trainer_cores),
                                    "engine_cores": format_cores(engine_cores)}
            by_key = [{} for _ in range(repeats)]
            for r, (key, run_name, extra) in interleave.sync_schedule(planned, repeats):
                log(f"[compare-sync] behav, {' '.join(extra)}" + (f" (repeat {r + 1} of {repeats})" if repeats > 1
                                                                   else "") + " ...")
                run_dir = out / run_name if r == 0 else out / "repeats" / f"{run_name}_{r + 1}"
                by_key[r][key] = run_strategy({"config": config, "overrides": [*overrides, *extra],
                                               "strategy": "behav", "steps": steps, "run_dir": str(run_dir),
                                               "verify": False}, pool)["records"]

        replay = None
        if cfg.rollout.routing_replay:
            log("[routing replay] train steps without and with replay ...")
            replay = replay_cost.run_measure(config, overrides)
            log("[routing replay] engine batches without and with captured routes ...")
            replay.update(measure_engine_capture(cfg, pool))
    meta["loadavg_end"] = os.getloadavg()[0]
    rep = round_reports.combine_reports([report.build_report(runs, by_key[r], meta=meta)
                                      for r, runs in enumerate(rounds)])
    markdown = report_render.render_markdown(rep)
    if rep["ratios"]:
        markdown += "\n## Step time ratios\n\n" + "\n".join(interleave.ratio_lines(rep)) + "\n"
    if replay is not None:
        rep["routing_replay"] = replay
        markdown += replay_cost.render_markdown(replay)
    write_report(out, rep, markdown)
    if strategies:
        plots.overhead_plot(rep, out / "overhead.png")
        plots.reward_plot({n: r["records"] for n, r in rounds[0].items()}, out / "reward.png")
    return rep


def measure_engine_capture(cfg: MegaRLConfig, pool: EnginePool) -> dict[str, Any]:
    """The engines' side of routing replay's cost, on the run's first pooled engine
    (megarl/bench/replay_engine_cost.py)."""
    import asyncio

    from megarl.models.bridge import read_hf_config

    ckpt = ensure_checkpoint(cfg)
    hf = read_hf_config(ckpt)
    pool.use(cfg, ckpt)
    _, client = pool.engine(0)
    return asyncio.run(replay_engine_cost.measure(client, cfg, int(hf["vocab_size"]),
                                                  int(hf["max_position_embeddings"])))


def write_report(out: Path, rep: dict[str, Any], markdown: str) -> None:
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(markdown)


if __name__ == "__main__":
    run_one(json.loads(sys.argv[1]))
