"""Run the README's first command (`bash scripts/demo.sh`) several times and count how many learn.

Each run is a fresh draw: rollouts are asynchronous, so which policy version samples which token depends
on timing and a rerun of a seed is another run. Runs go one after the other (two cores hold one run);
``--loaded K`` runs K of them beside a second CPU-bound process (a busy machine). Every run prints its
held-out pass@1 curve as it ends; the last line is the count at ``--goal`` of the final evaluation.

    python scripts/demo_runs.py --runs 10 --seeds 0,1,2 --loaded 3 --out runs/demo_runs [-- key=value ...]

Writes OUT/runs.jsonl (one line per run: seed, loaded, whole-command seconds, exit code, the curve) and
OUT/run_I/ (each run's directory: metrics.jsonl, console.log). ``--from-runs OUT/runs.jsonl`` prints the
table of a finished measurement again without running anything.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_curve(metrics_path: Path) -> dict[int, float]:
    """Held-out pass@1 by step, from a run's metrics.jsonl evaluation lines."""
    curve: dict[int, float] = {}
    if not metrics_path.exists():
        return curve
    for line in metrics_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/pass@1" in rec and "step" in rec:
            curve[int(rec["step"])] = float(rec["eval/pass@1"])
    return curve


def seed_overrides(seed: int) -> list[str]:
    """Seed 0 is the first command as written; another seed gets an init checkpoint of its own."""
    if seed == 0:
        return []
    return [f"trainer.seed={seed}", f"model.init_seed={seed}",
            f"model.checkpoint=runs/checkpoints/tiny_qwen3_chat_seed{seed}"]


def plan_runs(n_runs: int, seeds: list[int], n_loaded: int) -> list[tuple[int, bool]]:
    """(seed, loaded) per run: seeds in turn; the loaded runs spread over the measurement (not bunched at its
    end) and over the seeds (the j-th loaded run takes the j-th seed), so that load and seed are not confounded."""
    if not 0 <= n_loaded <= n_runs:
        raise SystemExit(f"--loaded {n_loaded} must be between 0 and --runs {n_runs}")
    plan = [seeds[i % len(seeds)] for i in range(n_runs)]
    loaded: set[int] = set()
    for j in range(n_loaded):
        target = (j + 0.5) * n_runs / n_loaded
        free = [i for i in range(n_runs) if i not in loaded]
        same_seed = [i for i in free if plan[i] == seeds[j % len(seeds)]]
        loaded.add(min(same_seed or free, key=lambda i: (abs(i - target), i)))
    return [(seed, i in loaded) for i, seed in enumerate(plan)]


def _burn() -> None:  # pragma: no cover - runs in the load process
    while True:
        pass


def run_one(index: int, seed: int, loaded: bool, out: Path, overrides: list[str]) -> dict:
    run_dir = out / f"run_{index}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(ROOT / "scripts" / "demo.sh"), *seed_overrides(seed), *overrides,
           f"logging.output_dir={run_dir}"]
    burner = multiprocessing.Process(target=_burn, daemon=True) if loaded else None
    if burner is not None:
        burner.start()
    t0 = time.monotonic()
    try:
        with open(run_dir / "console.log", "w") as log:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    finally:
        if burner is not None:
            burner.terminate()
            burner.join()
    return {"run": index, "seed": seed, "loaded": loaded, "whole_s": round(time.monotonic() - t0, 1),
            "rc": rc, "overrides": overrides, "curve": read_curve(run_dir / "metrics.jsonl")}


def final_pass1(rec: dict) -> float | None:
    curve = {int(k): v for k, v in rec["curve"].items()}
    return curve[max(curve)] if curve and rec["rc"] == 0 else None


def format_run(rec: dict) -> str:
    curve = " ".join(f"{k}:{v:.3f}" for k, v in sorted((int(k), v) for k, v in rec["curve"].items()))
    load = "loaded" if rec["loaded"] else "quiet "
    return (f"run {rec['run']:2d} seed {rec['seed']} {load} rc={rec['rc']} "
            f"{rec['whole_s'] / 60:4.1f} min  pass@1 {curve or '-'}")


def summary(records: list[dict], goal: float) -> str:
    finals = [final_pass1(r) for r in records]
    n_ok = sum(f is not None and f >= goal for f in finals)
    n_loaded = sum(r["loaded"] for r in records)
    n_loaded_ok = sum(f is not None and f >= goal for f, r in zip(finals, records) if r["loaded"])
    slowest = max((r["whole_s"] for r in records), default=0.0)
    return (f"{n_ok} of {len(records)} runs at held-out pass@1 >= {goal} at their last evaluation "
            f"({n_loaded_ok} of {n_loaded} loaded); slowest whole command {slowest / 60:.1f} min")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="how many runs of the first command")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, taken in turn")
    ap.add_argument("--loaded", type=int, default=0, help="how many runs go beside a CPU-burning process")
    ap.add_argument("--goal", type=float, default=0.5, help="the pass@1 a run must reach at its last evaluation")
    ap.add_argument("--out", default="runs/demo_runs", help="directory for runs.jsonl and each run's directory")
    ap.add_argument("--from-runs", default="", help="print the table of a finished runs.jsonl and exit")
    ap.add_argument("overrides", nargs="*", help="key=value overrides given to every run (after --)")
    args = ap.parse_args(argv)
    if args.from_runs:
        records = [json.loads(x) for x in Path(args.from_runs).read_text().splitlines() if x.strip()]
        for rec in records:
            print(format_run(rec))
        print(summary(records, args.goal))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    records = []
    with open(out / "runs.jsonl", "a") as sink:
        for index, (seed, loaded) in enumerate(plan_runs(args.runs, seeds, args.loaded)):
            rec = run_one(index, seed, loaded, out, args.overrides)
            records.append(rec)
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(format_run(rec), flush=True)
    print(summary(records, args.goal), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
