"""`megarl plan`: the placement plan of a config, and with ``--cost`` what each recovery strategy costs on it.

On GPUs it also prints the memory plan (megarl/launch/memory.py): the peak of
a trainer, engine and dedicated-scorer GPU by part, and exits 1 when one does
not fit ``placement.gpu_memory_gb``, naming the settings that would. The host
memory of a trainer node (megarl/launch/host_memory.py) is printed on GPUs, and
on either device when ``placement.host_memory_gb`` is set; a node that would
hold more than that is refused the same way. On GPUs the checkpoint is planned
too (megarl/launch/save_plan.py): the bytes each trainer node writes and the
time that takes at ``--disk-gb-s``; a stop checkpoint that cannot finish within
the stop budget (``logging.stop_grace_s``, Slurm's signal lead) is refused.

``--cost`` prints the cost model's table (megarl/launch/cost.py) for every strategy with
the assumptions it uses (flags below); ``--calibrate SWEEP_REPORT`` fits the model's CPU
constants on a `megarl bench --sweep` report and prints predicted against measured costs.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from megarl.config.loader import field_docs
from megarl.errors import ConfigError
from megarl.launch import cost, host_memory, memory, save_plan
from megarl.launch.overlays import add_overlay_flags, command_overrides
from megarl.launch.placement import load_hf_config, resolve_plan


def register(sub) -> None:
    p = sub.add_parser("plan", help="placement plan of a config; --cost: what each recovery strategy costs on it")
    p.add_argument("--config", help="run config YAML (e.g. configs/qwen3_4b_h100.yaml)")
    p.add_argument("--nodes", type=int, help="simulate an allocation of this many nodes (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node of the simulated allocation")
    add_overlay_flags(p)
    p.add_argument("--cost", action="store_true", help="print the cost model per recovery strategy")
    p.add_argument("--calibrate", metavar="SWEEP_REPORT",
                   help="fit the CPU constants on a `megarl bench --sweep` report.json; print predicted vs measured")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--signal-lead-s", type=float, default=None,
                   help="Slurm's --signal lead (seconds) a stop checkpoint must fit (default: launch/slurm.sbatch's)")
    docs = field_docs(cost.Assumptions)
    for f in fields(cost.Assumptions):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=None,
                       help=f"--cost assumption (default {f.default:g}): " + docs.get(f.name, "").replace("%", "%%"))
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. rollout.eta=4")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.calibrate:
        return _calibrate(args)
    from megarl.builder import load_run_config  # the strategies' config classes (torch)
    from megarl.commands.launch import allocation
    from megarl.losses.policy import normalizer_needs_anchor

    overrides = command_overrides(args.recovery, args.overlay, args.overrides)
    cfg = load_run_config(args.config, overrides)
    hf, source = load_hf_config(cfg, overrides)
    from megarl.preflight import check_config  # the data and model modules: only when the command runs

    check_config(cfg, hf)  # the checks `megarl train` makes before it starts, before any process here
    args.dry_run, args.launcher = True, None
    plan = resolve_plan(cfg, hf, allocation(args, cfg), config_path=args.config or "", overrides=overrides)
    mem = memory.memory_plan(cfg, hf, plan) if plan.device == "gpu" else None
    host = host_memory.planned(cfg, hf, plan)
    disk = args.disk_gb_s if args.disk_gb_s is not None else cost.Assumptions().disk_gb_s
    save = (save_plan.save_plan(cfg, hf, plan, disk, args.signal_lead_s, host.total if host else 0.0)
            if plan.device == "gpu" else None)
    if not args.cost:
        if args.json:
            print(json.dumps({"plan": plan.to_dict(), "memory": mem and memory.as_dict(mem),
                              "host_memory": host and host_memory.as_dict(host),
                              "checkpoint": save and save_plan.as_dict(save)}, indent=1))
        else:
            print(f"megarl plan: {args.config or '(defaults)'} (model fields from {source})\n{plan.describe()}")
            for part in (mem, host, save):
                if part is not None:
                    print(part.describe())
        return _fits(mem, host, save)
    given = {f.name: getattr(args, f.name) for f in fields(cost.Assumptions) if getattr(args, f.name) is not None}
    a = cost.Assumptions(**given)
    costs = cost.strategy_costs(cfg, hf, plan, a, interpolation_forward=normalizer_needs_anchor(cfg.loss))
    lay = cost.layout(cfg, hf, plan)
    if args.json:
        print(json.dumps({"layout": lay, "assumptions": asdict(a), "costs": costs}, indent=1))
    else:
        print(cost.render_costs(costs, lay, cfg, a, f"{args.config or '(defaults)'} (model fields from {source})"))
        for part in (mem, host, save):
            if part is not None:
                print(part.describe())
    return _fits(mem, host, save)


def _fits(*parts) -> int:
    """1 (with the reasons on stderr) when a GPU or a trainer node of the plan would run out of memory."""
    problems = host_memory.problems(*parts)
    for problem in problems:
        print(f"megarl plan: does not fit: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _calibrate(args) -> int:
    path = Path(args.calibrate)
    if not path.is_file():
        raise ConfigError(f"--calibrate {path}: no such file; give the report.json of `megarl bench --sweep`")
    report = json.loads(path.read_text())
    if "sweep" not in report:
        raise ConfigError(f"--calibrate {path}: not a sweep report (no 'sweep' section); run `megarl bench --sweep`")
    try:
        constants = cost.fit_cpu_constants(report)
    except ValueError as e:
        raise ConfigError(f"--calibrate {path}: {e}") from None
    cmp = cost.compare_cpu(report, constants)
    if args.json:
        json.dump({"constants": asdict(constants), **cmp}, sys.stdout, indent=1)
        print()
    else:
        print(cost.render_calibration(constants, cmp))
    return 0
