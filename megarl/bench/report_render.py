"""Render the bench report (megarl/bench/report.py ``build_report``) as report.md and as a rich table on stdout."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from megarl.bench import interleave
from megarl.bench.report import PHASES, STALL_PARTS

COLUMNS = (("strategy", "strategy"), ("step_time_s_median", "step s (median)"),
           ("recovery_s_median", "recovery s (median)"), ("critical_path_overhead_frac", "critical path %"),
           ("gen_stall_frac", "engine stall %"), ("peak_rss_mb", "peak RSS MB"),
           ("extra_param_copies", "extra copies"), ("bytes_moved", "MB moved"),
           ("max_abs_err_vs_exact", "max abs err vs exact"))


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if key.endswith("_frac"):
        return f"{100 * v:.1f}"
    if key == "bytes_moved":
        return f"{v / 1e6:.1f}"
    if key == "peak_rss_mb":
        return f"{v:.0f}"
    if key == "extra_param_copies":
        return f"{v:g}"
    if key == "max_abs_err_vs_exact":
        return f"{v:.2e}"
    return f"{v:.4f}"


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    return [[name, *(_fmt(k, s[k]) for k, _ in COLUMNS[1:])] for name, s in report["strategies"].items()]


def target_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for t in report["targets"]:
        status, value = interleave.target_cells(t)
        lines.append(f"{status}  {t['target']}: {value} (target {t['op']} {t['bound']:g})")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    meta = report.get("meta", {})
    head = [h for _, h in COLUMNS]
    overrides = " ".join(f"`{o}`" for o in meta.get("overrides", []))
    out = ["# megarl bench", "",
           f"Config `{meta.get('config', '?')}`{' with ' + overrides if overrides else ''}, "
           f"{meta.get('steps', '?')} steps per run, eta={meta.get('eta', '?')}, "
           f"{meta.get('runs', 'one run each, one after another')}.", ""]
    if "cpu_count" in meta:
        out += [f"Machine: {meta['cpu_count']} CPUs, load average {meta['loadavg_start']:.2f} at the start and "
                f"{meta['loadavg_end']:.2f} at the end (other processes share the cores: single runs are noisy).",
                ""]
    strategies = report["strategies"]
    if strategies:
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    else:
        out.append("No strategy runs (--strategies none).")
    out += ["", "## Async vs sync (behav)", "", *async_sync_lines(report)]
    if strategies:
        out += ["", "## Publish stall per publish (median ms)", "",
                *stall_table(report.get("publish_stall_s_median", {}))]
    lag = {n: s for n, s in strategies.items() if "scorer_lag_s_median" in s}
    if lag:
        out += ["", "## Dedicated scorer lag", ""]
        if any(s["critical_path_overhead_frac"] is None for s in lag.values()):
            out += [f"On {meta.get('cpu_count', '?')} CPUs the dedicated scorer has no core of its own: it shares "
                    "the trainer's and the engines' cores, so its share of the trainer's critical path would measure "
                    "that contention, not the design. It is not reported (n/a above); its lag is.", ""]
        out += ["| strategy | segments waiting (median) | seconds behind (median) | seconds behind (max) |",
                "|---|---|---|---|"]
        out += [f"| {n} | {s['scorer_pending_segments_median']:g} | {s['scorer_lag_s_median']:.3f} | "
                f"{s['scorer_lag_s_max']:.3f} |" for n, s in lag.items()]
    out += ["", "## Targets", "", "```", *target_lines(report), "```"]
    if strategies:
        out += ["", "## Median seconds per step by phase", ""]
        phases = report.get("phases_s_median", {})
        cols = [*PHASES, "step"]
        out += ["| strategy | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
        out += [f"| {n} | " + " | ".join(f"{p[c]:.4f}" for c in cols) + " |" for n, p in phases.items()]
    out += ["", "## Definitions", "", *_DEFINITIONS, ""]
    return "\n".join(out)


def async_sync_lines(report: dict[str, Any]) -> list[str]:
    """The async-vs-sync section: shared cores, then disjoint cores (megarl/bench/compare_sync.py)."""
    avs, cs = report["async_vs_sync"], report.get("meta", {}).get("compare_sync", {})
    if avs.get("throughput_ratio") is None and avs.get("throughput_ratio_disjoint_cores") is None:
        return ["Not measured (run with --compare-sync)."]
    eta = cs.get("eta", report.get("meta", {}).get("eta", "?"))
    lines = [f"Trained tokens per second after step 1, behav, async (eta={eta}) vs sync (eta=0):", ""]
    for suffix, key, where in (("", "throughput_ratio", "trainer and engines on all cores"),
                               ("_disjoint", "throughput_ratio_disjoint_cores",
                                f"trainer on core(s) {cs.get('trainer_cores', '?')}, engines on core(s) "
                                f"{cs.get('engine_cores', '?')}")):
        if avs.get(key) is not None:
            lines.append(f"- {where}: {avs[f'tokens_per_s_async{suffix}']:.1f} async vs "
                         f"{avs[f'tokens_per_s_sync{suffix}']:.1f} sync, ratio {interleave.throughput_text(avs, key)}")
    return lines


def stall_table(stalls: dict[str, dict[str, float] | None]) -> list[str]:
    """Markdown rows of :func:`publish_stall` per strategy, in milliseconds."""
    cols = (*STALL_PARTS, "stall")
    out = ["| strategy | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, s in stalls.items():
        out.append(f"| {name} | " + (" | ".join(f"{1e3 * s[c]:.1f}" for c in cols) if s else "no publish") + " |")
    return out


_DEFINITIONS = [
    "- Seconds are per optimizer step, over steps 2..N (step 1 also holds start-up); the verifier's truth "
    "forwards and parameter copies are measured and subtracted from recovery, step, wall and stall times.",
    "- critical path % = sum(recovery in anchor (dedicated waits included) + publish recovery + recovery hooks "
    "at publish and after the optimizer step) / sum(step time).",
    "- engine stall % = seconds engines were stopped by publishing / wall seconds, both from the end of "
    "step 1 to the end of the run.",
    "- peak RSS = sampled peak of the summed resident memory of the trainer process and its children "
    "(engines, reward workers, dedicated scorer); shared pages count once per process.",
    "- MB moved = recovery bytes moved + publishes x size of one HF weights checkpoint.",
    "- max abs err = largest |anchor - true logp_old| over all policy tokens (approximate anchors differ "
    "by design).",
    "- Phase medians are taken separately, so a bar's stack need not equal the median step time "
    "(marked on the plot).",
    "- Publish stall parts: drain = abort every request and wait for it to return; recovery = the strategy's "
    "before_publish; engine_* = the slowest engine's abort, pause, reload, prefix-cache reset, relabel+resume; "
    "sync_other = weight-sync time outside those (HTTP, the broadcast wire); hooks = on_weights_published; "
    "stall = all of it (verifier copies removed). Medians per part, so the parts need not add up to the stall.",
]


def print_table(report: dict[str, Any]) -> None:
    """The table and the target lines on stdout (rich)."""
    table = Table(title="megarl bench")
    for i, (_, head) in enumerate(COLUMNS):
        table.add_column(head, justify="left" if i == 0 else "right")
    for row in table_rows(report):
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    for key, label in (("throughput_ratio", "async / sync throughput"),
                       ("throughput_ratio_disjoint_cores", "async / sync throughput on disjoint cores")):
        console.print(f"{label}: {interleave.throughput_text(report['async_vs_sync'], key)}")
    for line in target_lines(report):
        style = "green" if line.startswith("PASS") else "red" if line.startswith("FAIL") else "yellow"
        console.print(line, style=style, markup=False, highlight=False)
