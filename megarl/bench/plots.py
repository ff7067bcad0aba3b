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


def _moving_average(xs: list[float], window: int) -> list[float]:
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
        ax.plot(wall, _moving_average(reward, window), linestyle=styles[(i // len(colors)) % len(styles)],
                color=color, linewidth=2, label=name)
    ax.set_xlabel("wall time since the training loop started (s)")
    ax.set_ylabel("mean batch reward")
    ax.set_title(f"Reward vs wall time per recovery strategy\n"
                 f"(lines: {window}-step moving average; dots: single steps)")
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
