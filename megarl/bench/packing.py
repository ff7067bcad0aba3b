"""``megarl bench --packing``: the packing plan against the round-robin deal it replaced.

Two measurements. The table compares, on batches of row lengths drawn from distributions shaped
like RL runs, the plan megarl used before (row i on DP rank i % dp, rectangles, dummies up to the
largest count: megarl/trainer/packing.py ``round_robin_plan``) with the current one
(``plan_packing``) in the padded layout, at several data-parallel sizes: padding share; the
slowest DP rank's workload (the estimate the plan balances, padding included) over the mean
rank's, and over the padding-free mean (the same denominator for both plans); micro-batches per
rank; dummies. ``bound`` is the slowest/padding-free mean no plan can beat: the heaviest single
row's workload over that mean. Then the same plan for the THD layout (no padding at tp 1), and the
plan's own time (CPU time of one ``plan_packing``, mean over the batches; every rank plans every
batch before its forward), padded and THD. The step time runs the real trainer on 2 CPU ranks (torchrun, gloo;
megarl/bench/packing_step.py) with both plans alternately in one run and reports the ratio.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

from megarl.errors import ConfigError
from megarl.trainer.packing import DEFAULT_LINEAR_WEIGHT, plan_packing, round_robin_plan, row_workload

DP_SIZES = (1, 2, 8, 64)


def long_tail(rng: random.Random, scale: float = 1.0) -> int:
    """A reasoning run's row: a prompt of ~200 tokens and an answer of 100-16k, lognormal (median ~1.8k)."""
    prompt = int(rng.gauss(200, 30))
    answer = int(min(16000, max(100, rng.lognormvariate(7.5, 1.0))))
    return max(2, int((prompt + answer) * scale))


def bimodal(rng: random.Random, scale: float = 1.0) -> int:
    """Short answers with a fifth of the rows running to the 16k limit (truncated reasoning)."""
    answer = 16000 if rng.random() < 0.2 else rng.randint(100, 1500)
    return max(2, int((int(rng.gauss(200, 30)) + answer) * scale))


DISTRIBUTIONS = {"long_tail": long_tail, "bimodal": bimodal}


def batches(dist: str, n_rows: int, n_batches: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(f"{dist}-{seed}")
    return [[DISTRIBUTIONS[dist](rng) for _ in range(n_rows)] for _ in range(n_batches)]


def recorded_batches(run_dir: str | Path) -> list[list[int]]:
    """The batches a run trained, as row lengths (prompt + response tokens): ``n_tokens`` of each step in
    RUN_DIR/trained_ids.jsonl (steps that trained nothing left out)."""
    path = Path(run_dir) / "trained_ids.jsonl"
    if not path.is_file():
        raise ConfigError(f"--packing-runs {run_dir}: no {path.name} there; give the directory of a megarl run "
                          f"(logging.output_dir)")
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = [r["n_tokens"] for r in steps if r.get("n_tokens")]
    if not out:
        raise ConfigError(f"--packing-runs {run_dir}: {path} records no row lengths (n_tokens: written by runs of "
                          f"this megarl version and later); rerun to record them")
    return out


def _stats(plan, lens: list[int], ideal: float) -> dict:
    w = plan.workloads(lens, DEFAULT_LINEAR_WEIGHT)
    return {"padding": plan.padding_share(lens), "slowest_over_mean": max(w) / ideal,
            "slowest_over_rank_mean": max(w) / (sum(w) / len(w)),
            "mbs_per_rank": len(plan.ranks[0]), "dummies": sum(1 for mbs in plan.ranks for g in mbs if not g)}


def table(n_rows: int = 256, n_batches: int = 8, budget: int = 32768, dp_sizes=DP_SIZES,
          recorded: dict[str, list[list[int]]] | None = None) -> list[dict]:
    """One row per (distribution, dp): before/after statistics, each the mean over ``n_batches`` batches
    (``recorded``: name -> a run's own batches, each step one batch). slowest/mean divides the heaviest DP
    rank's workload (padding included) by the padding-free mean, sum of the rows' workloads / dp, the same
    for both plans."""
    out = []
    sources = {d: batches(d, n_rows, n_batches) for d in DISTRIBUTIONS} | dict(recorded or {})
    for dist, dist_batches in sources.items():
        n_batches = len(dist_batches)
        for dp in dp_sizes:
            acc: dict[str, float] = {}
            for lens in dist_batches:
                work = [row_workload(n, DEFAULT_LINEAR_WEIGHT) for n in lens]
                ideal = sum(work) / dp
                plans = {"before": round_robin_plan(lens, dp, budget)}
                for tag, layout in (("after", "padded"), ("thd", "thd")):
                    start = time.process_time()
                    plans[tag] = plan_packing(lens, dp, budget, layout=layout)
                    took = (time.process_time() - start) * 1e3
                    acc[f"{tag}_plan_ms"] = acc.get(f"{tag}_plan_ms", 0.0) + took / n_batches
                for tag, plan in plans.items():
                    for k, v in _stats(plan, lens, ideal).items():
                        acc[f"{tag}_{k}"] = acc.get(f"{tag}_{k}", 0.0) + v / n_batches
                acc["bound"] = acc.get("bound", 0.0) + max(1.0, max(work) / ideal) / n_batches
            out.append({"distribution": dist, "dp": dp, **acc})
    return out


def render(rows: list[dict], n_rows: int, budget: int, n_batches: int = 8) -> str:
    lines = [f"{n_rows} rows per batch (a recorded run: its own), micro_batch_tokens={budget}, means over "
             f"{n_batches} batches (a recorded run: every step); "
             f"workload {DEFAULT_LINEAR_WEIGHT} L + L^2 per row (before -> after)", "",
             "| distribution | dp | padding | slowest/mean rank | slowest/padding-free mean | bound "
             "| micro-batches per rank | dummies | thd: slowest/mean rank, /padding-free mean, micro-batches "
             "| plan time, ms (padded, thd) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['distribution']} | {r['dp']} | {r['before_padding']:.1%} -> {r['after_padding']:.1%} | "
                     f"{r['before_slowest_over_rank_mean']:.3f} -> {r['after_slowest_over_rank_mean']:.3f} | "
                     f"{r['before_slowest_over_mean']:.3f} -> {r['after_slowest_over_mean']:.3f} | {r['bound']:.3f} | "
                     f"{r['before_mbs_per_rank']:.1f} -> {r['after_mbs_per_rank']:.1f} | "
                     f"{r['before_dummies']:.1f} -> {r['after_dummies']:.1f} | "
                     f"{r['thd_slowest_over_rank_mean']:.3f}, {r['thd_slowest_over_mean']:.3f}, "
                     f"{r['thd_mbs_per_rank']:.1f} | {r['after_plan_ms']:.1f}, "
                     f"{r['thd_plan_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def step_time(steps: int, timeout_s: float = 1800) -> dict:
    """Run megarl/bench/packing_step.py on 2 ranks (torchrun, gloo) and return its JSON line."""
    from megarl.rollout.client import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "megarl.bench.packing_step", "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the step-time run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def run_packing(output: str | None, n_rows: int, budget: int, steps: int, runs: list[str] = ()) -> str:
    """The table and the step-time ratio as markdown (also written to ``output`` when given); ``runs``: run
    directories whose trained batches are rows of the table too (named by the directory)."""
    recorded = {Path(r).name: recorded_batches(r) for r in runs}
    text = render(table(n_rows=n_rows, budget=budget, recorded=recorded), n_rows, budget)
    for name, got in recorded.items():
        lens = [n for b in got for n in b]
        text += (f"\n`{name}`: recorded, {len(got)} trained batches of {min(map(len, got))}-{max(map(len, got))} "
                 f"rows, {min(lens)}-{max(lens)} tokens per row (median {sorted(lens)[len(lens) // 2]})\n")
    if steps:
        t = step_time(steps)
        span = {k: f"{min(v):.3f}-{max(v):.3f}" for k, v in t["times"].items()}
        text += (f"\nCPU trainer step, dp 2 (torchrun, gloo), {t['model']}, {t['rows']} rows of {t['lengths']} "
                 f"tokens, micro_batch_tokens={t['budget']}, median of {t['steps']} steps each, alternating: "
                 f"before {t['before_s']:.3f} s (range {span['before']}), after {t['after_s']:.3f} s "
                 f"(range {span['after']}), before/after = {t['ratio']:.2f}x\n")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
    return text
