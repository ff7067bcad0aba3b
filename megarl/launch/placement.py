"""A run config + the model's HF config + an allocation -> a validated placement :class:`Plan`.

Nodes are taken from the allocation in order: ``placement.trainer_nodes``
trainer nodes, then ``placement.engine_nodes`` engine nodes, then (only with
``recovery.name=dedicated``) ``placement.dedicated_nodes`` nodes for the
old-logit scorer. GPUs inside a node are handed out from 0 upwards: trainer
ranks first, then engines (``placement.engine_tp`` GPUs each), then the
dedicated scorer. Every size that must divide another is checked here, before
anything starts, and a misfit names the numbers that do not fit.

On ``placement.device=cpu`` slots are processes: nothing counts GPUs, and the
engines and the scorer that share the controller's node are spawned by the
controller itself (what ``megarl train`` does on one machine), unless
``placement.dedicated_command`` asks for the scorer as a command of its own.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megarl.config.input_paths import where_looked
from megarl.errors import ConfigError
from megarl.launch.cluster import Allocation, compress_hosts
from megarl.launch.plan_parts import ServerPlan, TrainerPlan, with_server_addresses
from megarl.launch.plan_table import describe_plan
from megarl.launch.role_commands import render
from megarl.rollout.router import group_ranks

DEFAULT_MASTER_PORT = 29500
DEFAULT_WEIGHT_SYNC_PORT = 29600


@dataclass
class Plan:
    """Where every role runs. :meth:`commands` renders it for a launcher, :meth:`describe` for people."""

    device: str
    allocation: Allocation
    model: dict[str, Any]
    trainer: TrainerPlan
    engines: tuple[ServerPlan, ...]
    dedicated: ServerPlan | None
    master_addr: str
    master_port: int
    master_port_explicit: bool
    """False: one-node launchers may pick a free port instead of master_port."""
    weight_sync: str
    weight_sync_port: int
    backend: str
    recovery: str
    notes: list[str] = field(default_factory=list)
    config_path: str = ""
    overrides: tuple[str, ...] = ()

    @property
    def servers(self) -> tuple[ServerPlan, ...]:
        return self.engines + ((self.dedicated,) if self.dedicated else ())

    @property
    def hosts_used(self) -> list[str]:
        used = list(self.trainer.hosts)
        for s in self.servers:
            if s.host not in used:
                used.append(s.host)
        return used

    @property
    def weight_sync_world(self) -> int:
        """Ranks of the broadcast group: trainer rank 0 plus every GPU worker of the engines with own
        commands (the dedicated scorer reads each version from the run directory, not the group)."""
        return group_ranks([s.tp for s in self.engines if not s.spawned])[1]

    def weight_sync_rank(self, server: ServerPlan) -> int:
        """First rank of engine ``server``'s workers in the broadcast group (the router's layout)."""
        own = [s for s in self.engines if not s.spawned]
        if server not in own:
            raise ValueError(f"{server.name} is not an engine with its own command in this plan")
        return group_ranks([s.tp for s in own])[0][own.index(server)]

    def commands(self, launcher: str = "torchrun", *, python: str | None = None,
                 bootstrap_check: bool = False) -> list:
        """The exact per-role commands for ``launcher`` (torchrun, slurm or mpirun): a list of RoleCommand."""
        return render(self, launcher, python=python or sys.executable, bootstrap_check=bootstrap_check)

    def describe(self) -> str:
        return describe_plan(self)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["allocation"]["hosts"] = list(self.allocation.hosts)
        return d


# -- model facts ---------------------------------------------------------------------------------
def _num_experts(hf: dict) -> int:
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def _is_moe(hf: dict) -> bool:
    return _num_experts(hf) > 0


def param_counts(hf: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a Qwen3 / Qwen3-MoE config."""
    h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    heads, kv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    hd = int(hf.get("head_dim") or h // heads)
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o, q/k norms
    norms = 2 * h
    if _is_moe(hf):
        n_exp, topk, mi = _num_experts(hf), int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"])
        router = h * n_exp
        mlp_total, mlp_active = n_exp * 3 * h * mi + router, topk * 3 * h * mi + router
    else:
        mlp_total = mlp_active = 3 * h * int(hf["intermediate_size"])
    embed = vocab * h * (1 if hf.get("tie_word_embeddings") else 2) + h
    return embed + layers * (attn + norms + mlp_total), embed + layers * (attn + norms + mlp_active)


def model_summary(hf: dict) -> dict[str, Any]:
    total, active = param_counts(hf)
    out = {"architecture": (hf.get("architectures") or ["?"])[0], "layers": int(hf["num_hidden_layers"]),
           "heads": int(hf["num_attention_heads"]), "kv_heads": int(hf["num_key_value_heads"]),
           "vocab": int(hf["vocab_size"]), "params": total, "active_params": active}
    if _is_moe(hf):
        out.update(experts=_num_experts(hf), topk=int(hf["num_experts_per_tok"]))
    return out


def load_hf_config(cfg, overrides: list[str] | tuple[str, ...] = ()) -> tuple[dict, str]:
    """The model's HF config fields and where they came from.

    ``model.checkpoint``/config.json when it exists here, else
    ``placement.model_config``, else ``model.init_model`` (tiny random models).
    A config's ``placement.model_config`` describes the checkpoint that config
    names: when ``overrides`` point ``model.checkpoint`` at another one that
    cannot be read here, and name no model fields of their own, the plan is
    refused rather than made for the config's model (an 8B path planned as 4B).
    """
    ckpt = Path(cfg.model.checkpoint) / "config.json" if cfg.model.checkpoint else None
    if ckpt is not None and ckpt.is_file():
        return json.loads(ckpt.read_text()), str(ckpt)
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if "model.checkpoint" in keys and not keys & {"placement.model_config", "model.init_model"}:
        raise ConfigError(f"model.checkpoint={cfg.model.checkpoint} has no config.json on this machine, and the "
                          f"config's model fields (placement.model_config={cfg.placement.model_config or '(unset)'}) "
                          f"describe the checkpoint the config file names, not this one: plan where the checkpoint "
                          f"is readable, or pass placement.model_config=YAML with its config.json fields")
    for key, path in (("placement.model_config", cfg.placement.model_config),
                      ("model.init_model", cfg.model.init_model)):
        if path:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{key}={path} does not exist{where_looked(path)}")
            return yaml.safe_load(p.read_text()) or {}, str(p)
    raise ConfigError(f"cannot validate the plan: model.checkpoint={cfg.model.checkpoint!r} has no config.json here "
                      f"and neither placement.model_config nor model.init_model is set")


# -- checks ----------------------------------------------------------------------------------------
def _check_trainer_model(hf: dict, tp: int, pp: int, ep: int, world: int, what: str) -> None:
    from megarl.models.hf_config import validate_parallel  # imports torch: the launch package stays light

    try:
        validate_parallel(hf, tp, pp, ep, world)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


def _check_engine_model(hf: dict, etp: int) -> None:
    """vLLM shards attention heads and MLP/expert columns over its TP ranks; KV heads may be replicated."""
    heads, kv = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
    if heads % etp:
        raise ConfigError(f"engines: placement.engine_tp={etp} does not divide num_attention_heads={heads}")
    if kv % etp and etp % kv:
        raise ConfigError(f"engines: placement.engine_tp={etp} and num_key_value_heads={kv}: neither divides the other "
                          f"(vLLM splits or replicates KV heads)")
    key = "moe_intermediate_size" if _is_moe(hf) else "intermediate_size"
    if int(hf[key]) % etp:
        raise ConfigError(f"engines: placement.engine_tp={etp} does not divide {key}={hf[key]}")


def _positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{name.replace('__', '.')}={value} must be >= 1")


def _non_negative(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 0:
            raise ConfigError(f"{name.replace('__', '.')}={value} must be >= 0")


def _take_gpus(free: dict[str, list[int]], hosts: list[str], n: int) -> tuple[str, tuple[int, ...]] | None:
    """The first host in ``hosts`` with ``n`` free GPUs, and those GPUs (removed from ``free``)."""
    for h in hosts:
        if len(free[h]) >= n:
            ids, free[h] = tuple(free[h][:n]), free[h][n:]
            return h, ids
    return None


# -- the plan --------------------------------------------------------------------------------------
def resolve_plan(cfg, hf_config: dict, allocation: Allocation, *, config_path: str | Path = "",
                 overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """Place trainer, engines and dedicated scorer of ``cfg`` on ``allocation``; ConfigError on any misfit."""
    p, par = cfg.placement, cfg.parallel
    gpu = p.device == "gpu"
    _positive(placement__trainer_nodes=p.trainer_nodes, placement__engine_tp=p.engine_tp,
              rollout__n_engines=cfg.rollout.n_engines, parallel__tp=par.tp, parallel__pp=par.pp, parallel__ep=par.ep)
    _non_negative(placement__engine_nodes=p.engine_nodes, placement__dedicated_nodes=p.dedicated_nodes,
                  placement__trainer_ranks=p.trainer_ranks, placement__dedicated_tp=p.dedicated_tp)
    if gpu:
        _positive(placement__gpus_per_node=p.gpus_per_node)
    G = p.gpus_per_node
    notes: list[str] = list(allocation.notes)
    moe = _is_moe(hf_config)

    # trainer world
    T = p.trainer_nodes
    world = p.trainer_ranks or (T * G if gpu else T)
    if world % T:
        raise ConfigError(f"trainer: placement.trainer_ranks={world} is not divisible by placement.trainer_nodes={T}")
    rpn = world // T
    if gpu and rpn > G:
        raise ConfigError(f"trainer: {world} ranks on {T} node(s) is {rpn} per node, more than "
                          f"placement.gpus_per_node={G}")
    _check_trainer_model(hf_config, par.tp, par.pp, par.ep, world, "trainer")
    if gpu and T > 1 and rpn % par.tp:
        raise ConfigError(f"trainer: parallel.tp={par.tp} does not divide the {rpn} trainer ranks per node "
                          f"(tensor-parallel groups must stay inside a node)")
    if moe and par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(f"trainer: parallel.tp={par.tp} with an MoE model needs parallel.sequence_parallel=true "
                          f"(Megatron requires it for expert + tensor parallelism)")
    dp = world // (par.tp * par.pp)
    if cfg.trainer.batch_size % dp:
        raise ConfigError(f"trainer: trainer.batch_size={cfg.trainer.batch_size} is not divisible by the "
                          f"data-parallel size dp={dp} (= {world} ranks / (tp={par.tp} * pp={par.pp}))")
    expert_dp = world // (par.pp * par.ep * par.tp)

    # engines and scorer sizes
    n_eng, etp = cfg.rollout.n_engines, p.engine_tp
    _check_engine_model(hf_config, etp)
    if gpu and G % etp:
        raise ConfigError(f"engines: placement.engine_tp={etp} does not divide placement.gpus_per_node={G} "
                          f"(an engine stays inside one node)")
    uses_dedicated = cfg.recovery.name == "dedicated"
    D = p.dedicated_nodes if uses_dedicated else 0
    dtp = (p.dedicated_tp or 1) if uses_dedicated else 0
    if uses_dedicated:
        if dtp > 1:
            # the scorer is one process with one model replica (recovery/dedicated.py); a tensor-parallel scorer
            # would need a multi-rank world of its own, and its ranks would have to agree on every message
            raise ConfigError(f"dedicated scorer: placement.dedicated_tp={dtp}: the scorer runs as a single "
                              f"process (tp=1); set placement.dedicated_tp=1 and give it a GPU that holds the "
                              f"whole model")
        _check_trainer_model(hf_config, dtp, 1, 1, dtp, "dedicated scorer")
        if gpu and dtp > G:
            raise ConfigError(f"dedicated scorer: tp={dtp} exceeds placement.gpus_per_node={G}")
    else:
        for key, value in (("dedicated_nodes", p.dedicated_nodes), ("dedicated_tp", p.dedicated_tp)):
            if value:
                notes.append(f"placement.{key}={value} is not used: recovery.name={cfg.recovery.name} "
                             f"runs no dedicated scorer")

    # nodes of the allocation
    E = p.engine_nodes
    need = T + E + D
    if gpu:
        if allocation.gpus_per_node is None:
            notes.append(f"the allocation does not report its GPUs; assuming placement.gpus_per_node={G}")
        elif allocation.gpus_per_node < G:
            raise ConfigError(f"placement.gpus_per_node={G} but the allocation has {allocation.gpus_per_node} "
                              f"GPUs per node")
        elif allocation.gpus_per_node > G:
            notes.append(f"the allocation has {allocation.gpus_per_node} GPUs per node; the plan uses {G}")
    if allocation.n_nodes < need:
        groups = [("trainer", T), ("engines", E), ("dedicated", D)]
        if gpu:
            parts = " + ".join(f"{name} {n * G}" for name, n in groups if n or name == "trainer")
            have = allocation.gpus_per_node if allocation.gpus_per_node is not None else G
            raise ConfigError(f"plan needs {need * G} GPUs on {need} nodes ({parts}), allocation has "
                              f"{allocation.n_nodes * have} GPUs on {allocation.n_nodes} node(s)")
        parts = " + ".join(f"{name} {n}" for name, n in groups if n or name == "trainer")
        raise ConfigError(f"plan needs {need} nodes ({parts}), allocation has {allocation.n_nodes}")
    hosts = list(allocation.hosts)
    trainer_hosts, engine_hosts, ded_hosts = hosts[:T], hosts[T:T + E], hosts[T + E:need]
    if allocation.n_nodes > need:
        notes.append(f"{allocation.n_nodes - need} node(s) of the allocation stay idle: {compress_hosts(hosts[need:])}")

    free: dict[str, list[int]] = {h: list(range(G)) if gpu else [] for h in hosts[:need]}
    for h in trainer_hosts:
        free[h] = free[h][rpn:] if gpu else []
    next_port: dict[str, int] = {}

    def port_on(host: str) -> int:
        port = next_port.get(host, p.engine_port)
        next_port[host] = port + 1
        return port

    engines: list[ServerPlan] = []
    pool = engine_hosts or trainer_hosts
    for i in range(n_eng):
        if gpu:
            got = _take_gpus(free, pool, etp)
            if got is None:
                if E:
                    raise ConfigError(f"engines: rollout.n_engines={n_eng} x placement.engine_tp={etp} need "
                                      f"{n_eng * etp} GPUs; the {E} engine node(s) have {E * G}")
                raise ConfigError(f"engines: rollout.n_engines={n_eng} x placement.engine_tp={etp} need {n_eng * etp} "
                                  f"GPUs, but placement.engine_nodes=0 and the trainer nodes leave only "
                                  f"{T * (G - rpn)} free ({rpn} of {G} per node are trainer ranks); "
                                  f"set placement.engine_nodes or lower placement.trainer_ranks")
            engines.append(ServerPlan("engine", i, got[0], etp, got[1], port_on(got[0]), False))
        elif engine_hosts:
            host = engine_hosts[i % len(engine_hosts)]
            engines.append(ServerPlan("engine", i, host, etp, (), port_on(host), False))
        else:
            engines.append(ServerPlan("engine", i, trainer_hosts[0], etp, (), 0, True))

    dedicated = None
    if uses_dedicated:
        if gpu:
            where = ded_hosts or engine_hosts + trainer_hosts
            got = _take_gpus(free, where, dtp)
            if got is None:
                raise ConfigError(f"dedicated scorer: needs {dtp} GPU(s) (tp={dtp}) but no node of the plan has "
                                  f"{dtp} free; set placement.dedicated_nodes=1 or use fewer engines")
            dedicated = ServerPlan("dedicated", 0, got[0], dtp, got[1], port_on(got[0]), False)
        elif ded_hosts:
            dedicated = ServerPlan("dedicated", 0, ded_hosts[0], dtp, (), port_on(ded_hosts[0]), False)
        elif p.dedicated_command:  # its own command beside the trainer, as on a GPU node
            dedicated = ServerPlan("dedicated", 0, trainer_hosts[0], dtp, (), port_on(trainer_hosts[0]), False)
        else:
            dedicated = ServerPlan("dedicated", 0, trainer_hosts[0], dtp, (), 0, True)
    if gpu:
        for h in hosts[:need]:
            if free[h]:
                notes.append(f"{h}: {len(free[h])} of {G} GPUs idle")

    if cfg.rollout.weight_sync == "disk" and need > 1:
        notes.append("rollout.weight_sync=disk across nodes: run_dir must be on a disk every node shares")
    servers = with_server_addresses(engines + ([dedicated] if dedicated else []), p.server_addresses)
    engines, dedicated = servers[:len(engines)], (servers[-1] if dedicated else None)
    return Plan(
        device=p.device, allocation=allocation, model=model_summary(hf_config),
        trainer=TrainerPlan(tuple(trainer_hosts), rpn, world, par.tp, par.pp, par.ep, dp, expert_dp,
                            par.sequence_parallel, tuple(range(rpn)) if gpu else ()),
        engines=tuple(engines), dedicated=dedicated,
        master_addr=p.master_addr or trainer_hosts[0], master_port=p.master_port or DEFAULT_MASTER_PORT,
        master_port_explicit=bool(p.master_port), weight_sync=cfg.rollout.weight_sync,
        weight_sync_port=p.weight_sync_port or DEFAULT_WEIGHT_SYNC_PORT, backend=cfg.rollout.backend,
        recovery=cfg.recovery.name, notes=notes, config_path=str(config_path or ""), overrides=tuple(overrides))
