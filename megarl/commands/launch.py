"""`megarl launch`: place trainer, engines and dedicated scorer on an allocation and start them.

``--dry-run`` prints the plan and the exact per-role commands and starts
nothing (no GPU, Slurm or MPI needed). The scripts in launch/ are thin
wrappers around this command.

On GPUs it checks the memory plan first, as `megarl plan` does
(megarl/launch/memory.py): a layout where a trainer, engine or scorer GPU would
not fit ``placement.gpu_memory_gb``, or a trainer node that would hold more host
memory than ``placement.host_memory_gb`` (when set; megarl/launch/host_memory.py),
is refused with exit code 1, before anything starts, naming the settings that
would fit (a dry run prints the plan and commands, then refuses the same way);
``--skip-memory-check`` starts it anyway, and so does ``--bootstrap-check``,
which loads no model.

Stops: a stop signal to this command reaches the trainer ranks without any
launcher killing one mid-checkpoint, and the command exits with 75 when the
trainer stopped cleanly (megarl/launch/runner.py).
"""
from __future__ import annotations

import json
import os
import socket
import sys

from megarl.config.run_output import apply_umask
from megarl.errors import ConfigError
from megarl.isolation.key_files import KeyFiles, key_dir_base
from megarl.isolation.process_isolation import protect
from megarl.isolation.secret_env import STOP_KEY_ENV, give_secret
from megarl.launch import cluster, host_memory, memory
from megarl.launch.cluster import short_host
from megarl.launch.engine_key_env import ensure_run_keys
from megarl.launch.listen_check import loopback_listener_problem, master_host_problem
from megarl.launch.overlays import add_overlay_flags, command_overrides
from megarl.launch.placement import load_hf_config, resolve_plan
from megarl.launch.role_commands import LaunchSettings, render
from megarl.launch.runner import latch_launch_stops, run_commands, stop_marker_for


def register(sub) -> None:
    p = sub.add_parser("launch", help="plan and start a run on torchrun, Slurm or mpirun (--dry-run: print only)")
    p.add_argument("--config", help="run config YAML (e.g. configs/qwen3_30b_a3b_h100.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; start nothing")
    p.add_argument("--launcher", choices=["torchrun", "slurm", "mpirun"],
                   help="how ranks are started (default: slurm inside a Slurm job, else torchrun)")
    p.add_argument("--nodes", type=int, help="simulate an allocation of this many nodes (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node of the simulated allocation")
    add_overlay_flags(p)
    p.add_argument("--bootstrap-check", action="store_true",
                   help="start only the trainer ranks and run the rendezvous check instead of training")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory plan says a GPU would not fit placement.gpu_memory_gb "
                        "or a trainer node placement.host_memory_gb")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. placement.trainer_ranks=2")
    p.set_defaults(func=run)


def allocation(args, cfg):
    """The allocation a plan is made for: given (--nodes, --gpus-per-node), detected, or simulated for a dry run."""
    if args.nodes is not None or args.gpus_per_node is not None:
        return cluster.detect(args.nodes, args.gpus_per_node)
    if args.launcher == "slurm" and not args.dry_run and cluster.from_slurm() is None:
        raise ConfigError("--launcher slurm needs a Slurm allocation (SLURM_JOB_NODELIST is unset): "
                          "run inside sbatch/salloc, or add --dry-run")
    alloc = cluster.detect()
    p = cfg.placement
    need = p.trainer_nodes + p.engine_nodes + (p.dedicated_nodes if cfg.recovery.name == "dedicated" else 0)
    if args.dry_run and alloc.source == "local" and (p.device == "gpu" or need > 1):
        sim = cluster.simulated(need, p.gpus_per_node if p.device == "gpu" else 0)
        note = (f"no allocation found: simulated the {need} node(s) the config asks for; "
                f"pass --nodes/--gpus-per-node to try another")
        return cluster.Allocation(sim.hosts, sim.gpus_per_node, "simulated", notes=(note,))
    return alloc


def run(args) -> int:
    latch_launch_stops()  # a stop from here on is held, not fatal, and delivered once the trainer can take it
    from megarl.builder import load_run_config  # the strategies' config classes (torch): not for `megarl --help`

    launcher = args.launcher or ("slurm" if os.environ.get("SLURM_JOB_ID") else "torchrun")
    overrides = command_overrides(args.recovery, args.overlay, args.overrides)
    cfg = load_run_config(args.config, overrides)
    apply_umask(cfg.logging)  # the run directory and key files are this user's alone; every role inherits it
    hf, source = load_hf_config(cfg, overrides)
    from megarl.preflight import check_config  # the data and model modules: only when the command runs

    check_config(cfg, hf)  # the checks `megarl train` makes before it starts, before any process here
    plan = resolve_plan(cfg, hf, allocation(args, cfg), config_path=args.config or "", overrides=overrides)
    marker = stop_marker_for(cfg)
    run_dir = cfg.logging.resume or cfg.logging.output_dir
    settings = LaunchSettings(cfg.logging.stop_grace_s, tuple(cfg.placement.forward_env), str(marker),
                              os.path.abspath(run_dir) if run_dir else "")
    commands = render(plan, launcher, python=sys.executable, bootstrap_check=args.bootstrap_check, settings=settings)
    mem = memory.memory_plan(cfg, hf, plan) if plan.device == "gpu" else None
    host = host_memory.planned(cfg, hf, plan)
    problems = host_memory.problems(mem, host)
    if args.dry_run:
        if args.json:
            print(json.dumps({"plan": plan.to_dict(), "memory": mem and memory.as_dict(mem),
                              "host_memory": host and host_memory.as_dict(host), "launcher": launcher,
                              "commands": [{"name": c.name, "host": c.host, "argv": list(c.argv)} for c in commands]},
                             indent=1))
            return _memory_refusal(problems, args.skip_memory_check or args.bootstrap_check)
        print(f"megarl launch plan: {args.config or '(defaults)'} (model fields from {source})")
        print(plan.describe())
        for part in (mem, host):
            if part is not None:
                print(part.describe())
        print(f"\ncommands ({launcher}{', rendezvous check only' if args.bootstrap_check else ''}):")
        for c in commands:
            where = f" (run on {c.host})" if c.host else ""
            print(f"# {c.name}{where}\n{c.shell()}")
        return _memory_refusal(problems, args.skip_memory_check or args.bootstrap_check)
    if _memory_refusal(problems, args.skip_memory_check or args.bootstrap_check):
        return 1
    problem = loopback_listener_problem(plan, cfg.placement.weight_sync_bind) or master_host_problem(plan)
    if problem:  # before any process starts (megarl/launch/listen_check.py)
        raise ConfigError(problem)
    if launcher == "torchrun" and plan.allocation.source != "local":
        me = short_host(socket.gethostname())
        mine = [c for c in commands if short_host(c.host) == me]
        if not mine:
            hosts = sorted({c.host for c in commands})
            raise ConfigError(f"this host ({me}) has no role in the plan; run launch/torchrun.sh on each of: "
                              f"{', '.join(hosts)}")
        commands = mine
    keys = KeyFiles(ensure_run_keys(plan, launcher), key_dir_base(cfg))  # in memory, then one file per command
    give_secret(STOP_KEY_ENV, keys.keys[STOP_KEY_ENV])  # the trainer signs its stop marker with it, this checks it
    protect(key_dir_base(cfg))  # the key files' directory: hidden from the run's agent commands and sandboxes
    if settings.log_dir:  # the Slurm steps' logs go there from their first line, before the preflight makes it
        os.makedirs(settings.log_dir, exist_ok=True)
    return run_commands(commands, stop_marker=marker, stop_grace_s=cfg.logging.stop_grace_s, key_files=keys)


def _memory_refusal(problems: list[str], skip: bool) -> int:
    """1 (the reasons on stderr) when a GPU or a trainer node of the plan would not fit and the check is not
    skipped."""
    if not problems:
        return 0
    for problem in problems:
        print(f"megarl launch: does not fit: {problem}", file=sys.stderr)
    print("megarl launch: " + ("not refused (--skip-memory-check or --bootstrap-check)" if skip else
                               "refused; change the layout or pass --skip-memory-check to start it anyway"),
          file=sys.stderr)
    return 0 if skip else 1
