"""The bench's two figures (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.bench.report import PHASES, step_phases

PHASE_LABELS = {"wait_batch": "wait for batch", "recovery": "recovery (anchor)", "train_step": "train step",
                "publish_drain": "publish: drain engines", "publish_recovery": "publish: recovery",
                "weight_sync": "publish: weight sync", "recovery_hooks": "recovery hooks (publish, optimizer)",
                "other": "other"}


def _pyplot():
    import matplotlib  # lazy: heavy, and its backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def overhead_plot(report: dict[str, Any], path: str | Path) -> None:
    """Stacked bars: median seconds per step of each phase, per strategy; a tick marks the median step time."""
    plt = _pyplot()
    phases = report["phases_s_median"]
    names = list(phases)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 4.5), 5.0))
    colors = plt.get_cmap("tab10").colors
    bottoms = [0.0] * len(names)
    for i, phase in enumerate(PHASES):
        heights = [max(phases[n][phase], 0.0) for n in names]  # "other" can be a hair below 0 from timer jitter
        ax.bar(names, heights, bottom=bottoms, color=colors[i % len(colors)], label=PHASE_LABELS[phase],
               edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.scatter(names, [phases[n]["step"] for n in names], marker="_", s=900, linewidths=2, color="black", zorder=3,
               label="median step time\n(phase medians need not add up to it)")
    ax.set_ylabel("median seconds per step (s)")
    ax.set_xlabel("recovery strategy")
    ax.set_title("Where a training step's time goes, per recovery strategy")
    ax.tick_params(axis="x", rotation=20)
    by_label = dict(zip(*reversed(ax.get_legend_handles_labels())))
    # the step-time mark first, then the phases top-to-bottom like the stack
    order = [label for label in by_label if label.startswith("median")]
    order += [PHASE_LABELS[p] for p in reversed(PHASES)]
    ax.legend([by_label[label] for label in order], order, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=9, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def moving_average(xs: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        chunk = xs[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def reward_plot(records_by_name: dict[str, list[dict[str, Any]]], path: str | Path, window: int = 5) -> None:
    """Mean batch reward against wall time of the training loop (verifier time removed).

    Per-step rewards are noisy (a batch is a handful of prompts): faint dots
    per step, a line for the trailing ``window``-step moving average.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.0, 5.5))
    colors = plt.get_cmap("tab10").colors
    styles = ["-", "--", "-.", ":"]
    for i, (name, records) in enumerate(records_by_name.items()):
        wall = [p["wall"] for p in step_phases(records)]
        reward = [float(r.get("reward_mean") or 0.0) for r in records]
        color = colors[i % len(colors)]
        ax.scatter(wall, reward, s=8, color=color, alpha=0.35, linewidths=0)
        ax.plot(wall, moving_average(reward, window), linestyle=styles[(i // len(colors)) % len(styles)],
                color=color, linewidth=2, label=name)
    ax.set_xlabel("wall time since the training loop started (s)")
    ax.set_ylabel("mean batch reward")
    ax.set_title(f"Reward vs wall time per recovery strategy\n"
                 f"(lines: {window}-step moving average; dots: single steps)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _lines_by_strategy(ax, rows, x_key, y_key, colors, scale=1.0):
    for i, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        pts = sorted((r for r in rows if r["strategy"] == strategy and r[y_key] is not None), key=lambda r: r[x_key])
        if pts:
            ax.plot([r[x_key] for r in pts], [scale * r[y_key] for r in pts], marker="o", color=colors[i % len(colors)],
                    label=strategy)


def scaling_plot(report: dict[str, Any], path: str | Path) -> None:
    """Four panels of the sweep (megarl/bench/sweep.py): recovery seconds vs parameters (largest eta) and vs
    distinct versions per batch (largest model), publish stall vs parameters (smallest eta), extra bytes
    held vs eta (largest model). Log-log where the fits are power laws."""
    plt = _pyplot()
    rows = report["sweep"]["rows"]
    colors = plt.get_cmap("tab10").colors
    eta_hi, eta_lo = max(r["eta"] for r in rows), min(r["eta"] for r in rows)
    biggest = max(rows, key=lambda r: r["params"])["model"]
    fig, axes = plt.subplots(2, 2, figsize=(13.0, 9.5))
    (a, b), (c, d) = axes
    _lines_by_strategy(a, [r for r in rows if r["eta"] == eta_hi], "params", "recovery_s_median", colors)
    a.set(xscale="log", xlabel="total parameters", ylabel="recovery seconds per step (median)",
          title=f"Recovery cost vs model size (eta={eta_hi})")
    if any(r["recovery_s_median"] <= 0 for r in rows):
        a.set_yscale("symlog", linthresh=1e-4)  # strategies without a forward sit at 0
    else:
        a.set_yscale("log")
    _lines_by_strategy(b, [r for r in rows if r["model"] == biggest], "distinct_versions_mean", "recovery_s_median",
                       colors)
    b.set(xlabel="distinct policy versions per batch (mean)", ylabel="recovery seconds per step (median)",
          title=f"Recovery cost vs staleness ({biggest}, one point per eta)")
    _lines_by_strategy(c, [r for r in rows if r["eta"] == eta_lo], "params", "stall_per_publish_s", colors, 1e3)
    c.set(xscale="log", xlabel="total parameters", ylabel="engine stall per publish (ms, median)",
          title=f"Publish stall vs model size (eta={eta_lo})")
    _lines_by_strategy(d, [r for r in rows if r["model"] == biggest], "eta", "extra_bytes_held", colors, 1e-6)
    d.set(xlabel="eta (staleness bound)", ylabel="extra MB held (max)", title=f"Memory held vs eta ({biggest})")
    from matplotlib.ticker import NullFormatter

    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_xscale() == "log":
            ax.xaxis.set_minor_formatter(NullFormatter())  # a few decades at most: minor labels collide
    fig.tight_layout()
    handles, labels = a.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 0.97), frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def quality_plot(report: dict[str, Any], path: str | Path) -> None:
    """Reward vs step and vs wall time per (strategy, eta): the mean over seeds, shaded from the lowest to
    the highest seed; and the loss's active-token share vs step, mean over seeds (megarl/bench/quality.py)."""
    plt = _pyplot()
    curves = report["quality"]["curves"]
    colors = plt.get_cmap("tab10").colors
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(20.0, 5.5))
    mid.sharey(left)
    strategies = list(dict.fromkeys(c["strategy"] for c in curves))
    etas = sorted({c["eta"] for c in curves})
    for c in curves:
        color = colors[strategies.index(c["strategy"]) % len(colors)]
        style = ["-", "--", ":", "-."][etas.index(c["eta"]) % 4]
        label = f"{c['strategy']} eta={c['eta']}"
        for ax, x in ((left, c["step"]), (mid, c["wall_s"])):
            ax.plot(x, c["mean"], linestyle=style, color=color, linewidth=1.8, label=label)
            ax.fill_between(x, c["low"], c["high"], color=color, alpha=0.12, linewidth=0)
        pts = [(s, a) for s, a in zip(c["step"], c.get("active_frac") or []) if a is not None]
        right.plot([s for s, _ in pts], [a for _, a in pts], linestyle=style, color=color, linewidth=1.5, label=label)
    left.set(xlabel="optimizer step", ylabel=f"mean batch reward ({report['quality']['smooth']}-step moving average)",
             title="Reward vs step (line: mean over seeds; band: lowest to highest seed)")
    mid.set(xlabel="wall time of the training loop (s)", title="Reward vs wall time (same runs)")
    right.set(xlabel="optimizer step", ylabel="active-token share (kept by the loss)", ylim=(-0.02, 1.02),
              title="Active-token share vs step (mean over seeds)")
    for ax in (left, mid, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
