"""What `megarl advise` prints and writes: the strategy table, the reasons, advise.json and advise.png.

Table columns: strategy; measured cost per step (the strategy's own seconds on
the trainer's critical path, of the median step, medians over the interleaved
repeats, with the share's interval and the step's ratio to behav's and its
interval; the median publish stall; or why it was not measured); memory fit (the
plan's host bytes per trainer node, trainer and scorer GPU on GPU plans);
how far its anchor sits from the exact ``logp_old`` (mean |anchor - exact|
and the share of tokens it clips differently); the expected effect (what the
rules and megarl's grids say it does here).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megarl.advise.rules import EXACT
from megarl.bench.interleave import ratio_text

STRATEGIES = ("behav", "loglinear", "linear", "recompute", "ewma", "snapshot", "interrupt_sync", "dedicated")

#: what megarl's quality grids measured for each approximate anchor (docs/results.md, "Does exactness pay?")
GRID_EFFECT = {
    "behav": "anchor = logp_behav, the exact one within the gap; no forward, no copy; the grids' baseline",
    "recompute": "anchored at this step's weights: no gain on the grids, most tokens down-weighted at eta 8",
    "loglinear": "follows the policy; fast early, then ended below behav on the MoE grid (5 seeds)",
    "linear": "follows the policy; 0.57x behav's steps to the threshold at eta 8 (dense grid)",
    "ewma": "follows the policy; 0.5-0.65x behav's steps to the threshold at eta 8, above behav on the MoE grid",
}


def _cost_cell(m: dict[str, Any], name: str) -> str:
    run = m["cost"]["runs"].get(name)
    if run is None:
        return "not measured: " + m["cost"]["skipped"].get(name, "not asked for")
    stall = run.get("publish_stall_s_median")
    cell = f"+{run['added_step_s']:.3f} s of {run['step_time_s_median']:.3f} s"
    share, ratio = run.get("share_interval"), run.get("step_ratio_to_behav")
    if share and share["low"] is not None:
        cell += f" ({share['share']:.1%} [{share['low']:.1%}, {share['high']:.1%}])"
    if ratio and ratio["low"] is not None and name != "behav":
        cell += f"; step {ratio_text(ratio)} x behav's"
    return cell + (f"; stall {stall:.3f} s / publish" if stall is not None else "")


def repeats_line(m: dict[str, Any]) -> str:
    """How the costs were measured: the repeats, their order, the intervals (megarl/bench/interleave.py)."""
    c = m["cost"]
    if not c["runs"]:
        return "No timing runs."
    done = c.get("repeats_done", 1)
    said = f"Costs: medians over {done} of {c.get('repeats', 1)} repeats of {c.get('steps', '?')} steps, "
    if done < 2:
        return said + "so without intervals (--repeats 3 gives them)."
    return said + ("interleaved (every strategy once per round, the order reversed every other round); in [ ] a "
                   "90% t interval over the repeats: of the per-repeat shares of the step, and of the log of the "
                   "per-repeat step ratios to behav's.")


def _size(gb: float) -> str:
    return f"{gb:.1f} GB" if gb >= 0.1 else f"{gb * 1e3:.1f} MB"


def _memory_cell(m: dict[str, Any], name: str) -> str:
    mem = m["memory"]["strategies"].get(name)
    if mem is None:
        return "-"
    parts = [f"host +{_size(mem['host_gb_per_node'])} / node"]
    if mem["trainer_gpu_gb"] is not None:
        parts.append(f"trainer GPU {_size(mem['trainer_gpu_gb'])}")
    if mem["dedicated_gpus"] and m["memory"]["device"] == "gpu":
        parts.append(f"+{mem['dedicated_gpus']} GPU {_size(mem['dedicated_gpu_gb'])}")
    return ("fits: " if mem["fits"] else "DOES NOT FIT: " + "; ".join(mem["problems"]) + "; ") + ", ".join(parts)


def _distance_cell(m: dict[str, Any], name: str) -> str:
    if name in EXACT:
        return "exact (0)"
    a = m["calibration"]["anchors"].get(name)
    if a is None:
        return "-"
    return f"{a['mean']:.2g} mean, {a['p99']:.2g} p99; clips {a['clip_differs_frac']:.1%} differently"


def expected_effect(m: dict[str, Any], name: str) -> str:
    """One line: what choosing ``name`` changes here, from the measurements and the grids."""
    if name in EXACT:
        touched = m["calibration"]["rule"]["masked_frac"] + m["calibration"]["rule"]["downweighted_frac"]
        return (f"the exact anchor; the rule masks/down-weights {touched:.2%} of tokens under it"
                + ("" if m["recommendation"]["exactness_matters"] else "; cannot change the update here"))
    return GRID_EFFECT.get(name, "-")


def table_rows(m: dict[str, Any]) -> list[list[str]]:
    return [[name + (" (chosen)" if name == m["recommendation"]["strategy"] else ""), _cost_cell(m, name),
             _memory_cell(m, name), _distance_cell(m, name), expected_effect(m, name)] for name in STRATEGIES]


HEADER = ["strategy", "measured cost / step", "memory (plan)", "anchor distance from exact (nats)", "expected effect"]


def render_markdown(m: dict[str, Any]) -> str:
    """The table and the paragraph."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(m)]
    return "\n".join(lines) + "\n\n" + repeats_line(m) + "\n\n" + paragraph(m) + "\n"


def paragraph(m: dict[str, Any]) -> str:
    rec = m["recommendation"]
    st = m["calibration"]["staleness"]
    return (f"Recommended: {rec['strategy']}"
            + (", with rollout.routing_replay=true" if rec["routing_replay"] else "") + ". "
            + f"Measured over {m['calibration']['n_batches']} calibration steps at eta {m['config']['eta']} "
            + f"({st['spliced_frac']:.0%} of sequences spliced, lag up to {st['lag_max']}): "
            + "; ".join(rec["reasons"]) + ".")


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(m: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_clean(m), indent=2) + "\n")


def picture(m: dict[str, Any], path: Path) -> None:
    """advise.png: the gap's distribution, each anchor's distance from exact, each strategy's cost per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = m["calibration"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    g = cal["gap"]
    labels = list(g["hist"])
    axes[0].bar(labels, [g["hist"][k] for k in labels], color="tab:blue")
    axes[0].set_title(f"|logp_old - logp_behav| per token ({g['n']} tokens)")
    axes[0].set_xlabel("nats (decade)")
    axes[0].set_ylabel("tokens")
    names = [n for n in STRATEGIES if n in cal["anchors"]]
    axes[1].bar(names, [max(cal["anchors"][n]["mean"], 1e-12) for n in names], color="tab:orange", label="mean")
    axes[1].scatter(names, [max(cal["anchors"][n]["p99"], 1e-12) for n in names], color="k", zorder=3, label="p99")
    axes[1].set_yscale("log")
    axes[1].set_title("anchor distance from exact logp_old")
    axes[1].set_ylabel("nats per token")
    axes[1].legend()
    runs = m["cost"]["runs"]
    timed = [n for n in STRATEGIES if n in runs and runs[n].get("added_step_s") is not None]
    axes[2].bar(timed, [runs[n]["added_step_s"] for n in timed],
                color=["tab:green" if n == m["recommendation"]["strategy"] else "tab:gray" for n in timed])
    axes[2].axhline(0, color="k", lw=0.5)
    axes[2].set_title("measured critical-path seconds per step")
    axes[2].set_ylabel("s / step")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
