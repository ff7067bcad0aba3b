"""`megarl train` (and ``python -m megarl.train``): run the asynchronous RL loop from a config.

A process a launcher started for a server role of a plan (``MEGARL_ROLE=engine``
or ``dedicated``, megarl/launch/roles.py) runs the same command with the same
config and serves that role instead of training.

A stop signal (megarl/stop_protocol.py) is a stop for these roles too, not a
failure: an engine shuts down and exits with 75; the dedicated scorer keeps
serving the trainer's checkpoint (the trainer ends it, exit 0) and exits with
75 once ``logging.stop_grace_s`` passed without that. `megarl launch` counts
either as the run stopping (megarl/launch/runner.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading

from megarl.config.loader import dump_yaml
from megarl.errors import ConfigError
from megarl.isolation.secret_env import take_all_secrets
from megarl.launch.listen_check import gloo_interface_env, server_listen_address
from megarl.launch.overlays import add_overlay_flags, command_overrides
from megarl.launch.roles import RoleEnv, current_role
from megarl.platform import batch_invariant
from megarl.rollout.base import engine_options, wants_routed_experts
from megarl.rollout.server import serve
from megarl.stop_protocol import EXIT_STOPPED, STOP_SIGNALS, RunStopped, early_stop, stop_budget

log = logging.getLogger("megarl.serve_role")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a policy with asynchronous RL")
    p.add_argument("--config", help="YAML config (e.g. configs/tiny_cpu.yaml)")
    p.add_argument("--output-dir", help="run directory (default: a new timestamped directory under runs/)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest valid checkpoint (same config; it keeps "
                        "writing to RUN_DIR)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--check", action="store_true",
                   help="run every check a run makes before it starts (config, checkpoint, data, reward, agent), "
                        "then exit without starting anything or writing a run directory")
    add_overlay_flags(p)
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-3")
    p.set_defaults(func=run)


def run(args) -> int:
    with early_stop.installed():  # a stop signal from here on is latched (megarl/stop_protocol.py); put back after
        return _run(args)


def _run(args) -> int:
    # the loop's modules (torch, Megatron, the strategies) load only when the command runs, not for `megarl --help`
    from megarl.builder import describe_config, load_run_config
    from megarl.train import train

    if args.help_config:
        print("\n".join(describe_config()))
        return 0
    overrides = command_overrides(args.recovery, args.overlay, args.overrides)  # as `megarl launch` does
    if args.resume and args.output_dir:
        raise ConfigError("--resume RUN_DIR continues writing to RUN_DIR; drop --output-dir")
    if args.output_dir:
        overrides.append(f"logging.output_dir={args.output_dir}")
    if args.resume:
        overrides.append(f"logging.resume={args.resume}")
    cfg = load_run_config(args.config, overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if args.check:
        from megarl.preflight import check_only

        print(check_only(cfg))
        return 0
    role = current_role()
    take_all_secrets()  # held in memory from here on; /proc/<pid>/environ shows none (megarl/isolation/secret_env.py)
    if role.role != "trainer":
        if early_stop.received is not None:
            raise RunStopped(f"{role.role}: stopped by {early_stop.received} before it started serving")
        _stop_role_on_signals(role.role, cfg.logging.stop_grace_s)
        return serve_role(cfg, role)
    run_dir = train(cfg)
    print(f"run finished: {run_dir}")
    return 0


def serve_role(cfg, role: RoleEnv) -> int:
    """A process launched for a server role of a plan: a rollout engine, or the dedicated old-logit scorer.
    Returns the exit code: an engine serves until a stop signal shuts it down (75), the scorer until the
    trainer ends it (0)."""
    if role.role == "engine":
        tp = {"tensor_parallel_size": role.server_tp} if role.server_tp > 1 else {}
        if tp and cfg.rollout.backend != "vllm":
            raise ConfigError(f"placement.engine_tp={role.server_tp} needs rollout.backend=vllm "
                              f"(the hf engine runs one worker); set placement.engine_tp=1")
        routes = {"routed_experts": True} if wants_routed_experts(cfg.rollout) else {}
        resources = engine_options(cfg.rollout.backend, cfg.rollout.kv_cache_gb, cfg.rollout.cpu_threads,
                                   kv_block_size=cfg.rollout.kv_block_size)
        os.environ.update(batch_invariant.engine_env(cfg))  # read by vLLM in this process and its engine core
        host = engine_host(role)
        os.environ.update(gloo_interface_env(host))  # the broadcast's data plane where the trainer reaches it
        asyncio.run(serve(cfg.model.checkpoint, cfg.rollout.backend, host=host, port=role.server_port,
                          dtype=cfg.engine_dtype, **resources, **tp, **routes))
        # serve() returns only once SIGTERM/SIGINT (or SIGUSR1, passed on as SIGTERM) shut it down cleanly
        print(f"megarl engine: stopped by a stop signal, shut down (exit code {EXIT_STOPPED})", file=sys.stderr)
        return EXIT_STOPPED
    from megarl.builder import serve_dedicated_role  # heavy (torch, the strategies), as in run()

    serve_dedicated_role(cfg, role.server_port, server_host=role.server_host, controller=role.controller_host)
    return 0


def engine_host(role: RoleEnv) -> str:
    """The address a launched engine serves on: its node's in the plan (``MEGARL_SERVER_HOST``; this host's name
    without one), resolved here. A name that resolves to a loopback address here (an /etc/hosts line such as
    ``127.0.1.1 node03``) while the controller runs on another node is refused, naming the key to set
    (megarl/launch/listen_check.py)."""
    return server_listen_address(role.server_host or socket.gethostname(), role.controller_host)


def _stop_role_on_signals(role: str, grace_s: float) -> None:
    """Stop signals end a server role with exit code 75 (module doc); main thread only (signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    stop_budget.configure(grace_s)

    def engine_stop(signum, frame) -> None:
        if signum == signal.SIGUSR1:  # serving, SIGTERM is serve()'s clean shutdown; before, the branch below
            signal.raise_signal(signal.SIGTERM)
            return
        for s in STOP_SIGNALS:  # still loading: stop once, now
            signal.signal(s, signal.SIG_IGN)
        raise RunStopped(f"engine: stopped by {signal.Signals(signum).name} before it served")

    def scorer_stop(signum, frame) -> None:
        if stop_budget.started:
            return
        stop_budget.start()
        log.warning("%s: serving the trainer's checkpoint for at most %g s (logging.stop_grace_s)",
                    signal.Signals(signum).name, grace_s)
        timer = threading.Timer(grace_s, _exit_stopped, args=(signal.Signals(signum).name, grace_s))
        timer.daemon = True
        timer.start()

    for s in STOP_SIGNALS:
        signal.signal(s, engine_stop if role == "engine" else scorer_stop)


def _exit_stopped(name: str, grace_s: float) -> None:
    stop_budget.unfinished(f"the dedicated scorer's wait for the trainer to end it after {name}")
    logging.shutdown()
    os._exit(EXIT_STOPPED)  # from a timer thread: the scorer has nothing of its own to save
