"""Build a run from a config and train: the one entry point behind `megarl train` and the launchers.

``python -m megarl.train --config X [key=value ...]`` is the same as ``megarl train``.
``train(cfg, resume=RUN_DIR)`` continues a run from its newest valid checkpoint
(megarl/checkpoint.py): engines restart from the checkpoint's weights at its
version, the trainer, strategy, replay buffer, dataset and RNG continue, and the
run's logs are rewound to the checkpoint before new lines are appended.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.advantages import advantage_fn
from megarl.config import MegaRLConfig, load_config, save_config
from megarl.config.loader import to_dict
from megarl.data import PromptDataset
from megarl.evaluation import Evaluator
from megarl.errors import ConfigError, MegarlError
from megarl.launch.serve import serve_role
from megarl.losses.objective import loss_fn_factory, loss_fn_factory_for_run
from megarl.rewards.scorer import TrajectoryScorer
from megarl.rollout.base import engine_options, logprob_temperature, truncates_sampling
from megarl.rollout.client import connect_engine
from megarl.tokenizer import RunTokenizer

log = logging.getLogger("megarl.train")


def make_run_dir(cfg: MegaRLConfig) -> Path:
    if cfg.logging.output_dir:
        run_dir = Path(cfg.logging.output_dir)
    else:
        run_dir = Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*")):
        raise ConfigError(f"{run_dir} holds the checkpoints of an earlier run; continue it with "
                          f"`megarl train --config ... --resume {run_dir}` or choose another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def ensure_checkpoint(cfg: MegaRLConfig) -> Path:
    """The policy's HF checkpoint; written from ``model.init_model`` when it does not exist yet."""
    ckpt = Path(cfg.model.checkpoint)
    if not cfg.model.checkpoint:
        raise ConfigError("model.checkpoint is empty; set it to an HF checkpoint directory "
                          "(with model.init_model to create a random tiny one)")
    if not (ckpt / "config.json").is_file():
        if not cfg.model.init_model:
            raise ConfigError(f"model.checkpoint {ckpt} has no config.json; point it at an HF checkpoint "
                              f"or set model.init_model to a model YAML to create one")
        from megarl.models.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(cfg.model.init_model, ckpt, seed=cfg.model.init_seed)
    return ckpt


def validate(cfg: MegaRLConfig, hf: dict) -> None:
    """Inconsistent settings fail here, before anything starts."""
    if cfg.trainer.batch_size % cfg.rollout.group_size:
        raise ConfigError(f"trainer.batch_size={cfg.trainer.batch_size} must be a multiple of "
                          f"rollout.group_size={cfg.rollout.group_size} (batches hold whole groups)")
    if cfg.rollout.eta < 0:
        raise ConfigError(f"rollout.eta={cfg.rollout.eta} must be >= 0")
    if not 0.0 <= cfg.reward.max_fail_frac <= 1.0:
        raise ConfigError(f"reward.max_fail_frac={cfg.reward.max_fail_frac} must be in [0, 1]")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install wandb (or set logging.wandb=false)")
    k, eta = cfg.trainer.publish_every, cfg.rollout.eta
    if k < 1:
        raise ConfigError(f"trainer.publish_every={k} must be >= 1")
    # Refused rather than accounted for in the gate: the engines keep version v for k optimizer steps, so
    # a token sampled by v just before the next publish is trained k - 1 versions later at the earliest.
    # With k - 1 > eta no admission rule can keep the bound; a gate on the published version (the only
    # one that keeps it) admits (eta + 1) batches per version and then waits for a publish that needs k.
    if k > eta + 1:
        raise ConfigError(f"trainer.publish_every={k} with rollout.eta={eta}: the engines would trail the trainer "
                          f"by up to {k - 1} versions, more than eta allows, and the staleness gate would stop "
                          f"generation before the next publish; set trainer.publish_every <= {eta + 1} "
                          f"(rollout.eta + 1) or rollout.eta >= {k - 1}")
    max_len = int(hf.get("max_position_embeddings", 0))
    need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if max_len and need > max_len:
        raise ConfigError(f"data.max_prompt_len + rollout.max_new_tokens = {need} exceeds the model's "
                          f"max_position_embeddings {max_len}; lower one of them")
    ro = cfg.rollout
    engine_options(ro.backend, ro.kv_cache_gb, ro.cpu_threads)  # the engines' resources, checked before they start
    if truncates_sampling(ro.top_p, ro.top_k, int(hf.get("vocab_size") or 0)) and not cfg.loss.allow_truncated_sampling:
        raise ConfigError(f"rollout.top_p={ro.top_p}, rollout.top_k={ro.top_k} truncate the sampling distribution: "
                          f"logp_behav is then the log-prob under a renormalized truncated distribution that the "
                          f"trainer cannot reproduce from full logits, so r_d is biased; set rollout.top_p=1 and "
                          f"rollout.top_k=-1, or loss.allow_truncated_sampling=true to train anyway")


def refuse_unwired(cfg: MegaRLConfig) -> None:
    """Settings the config accepts (the GPU configs use them) but this training loop does not honour yet."""
    if cfg.advantage.kl_coef > 0 and cfg.placement.trainer_ranks > 1:
        raise ConfigError("advantage.kl_coef > 0 needs a single trainer rank so far; set advantage.kl_coef=0 "
                          "or placement.trainer_ranks=1")


def _workflow(cfg: MegaRLConfig, tokenizer: RunTokenizer):
    from megarl.workflows import build_workflow

    if cfg.rollout.workflow == "multi_turn":
        return build_workflow("multi_turn", cfg, tokenizer, env=cfg.rollout.tool_env,
                              max_turns=cfg.rollout.max_turns, max_response_len=cfg.rollout.max_new_tokens)
    return build_workflow(cfg.rollout.workflow, cfg, tokenizer)


def build_trainer(cfg: MegaRLConfig, ckpt: Path):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(str(ckpt), tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                           lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
                           adam_eps=cfg.trainer.adam_eps, grad_clip=cfg.trainer.grad_clip,
                           micro_batch_tokens=cfg.trainer.micro_batch_tokens, seed=cfg.trainer.seed,
                           use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                           lr_warmup_steps=cfg.trainer.lr_warmup_steps, lr_decay=cfg.trainer.lr_decay,
                           total_steps=cfg.trainer.total_steps, min_lr=cfg.trainer.min_lr, dtype=cfg.model.dtype,
                           sequence_parallel=cfg.parallel.sequence_parallel,
                           temperature=logprob_temperature(cfg.rollout.temperature))


def _follow(cfg: MegaRLConfig, ckpt: Path, run_dir: Path) -> None:
    """A trainer rank other than 0: replay rank 0's trainer and strategy events."""
    from megarl.trainer.spmd import ControlChannel, FollowerView, follow
    from recovery import registry
    from recovery.base import RecoveryContext

    trainer = build_trainer(cfg, ckpt)
    channel = ControlChannel()
    view = FollowerView()
    ctx = RecoveryContext(trainer=trainer, loss_cfg=cfg.loss, live_versions=view.live_versions,
                          live_trajectories=view.live_trajectories, run_dir=str(run_dir),
                          checkpoint_dir=str(ckpt), eta=cfg.rollout.eta, publish_every=cfg.trainer.publish_every,
                          is_driver=False)
    strategy = registry.build(cfg.recovery, ctx)
    try:
        follow(trainer, strategy, channel, loss_fn_factory(cfg.loss, strategy=cfg.recovery.name), view)
    finally:
        strategy.close()


def _prepare_resume(run_dir: Path, step_dir: Path, state: dict) -> tuple[int, tuple[str, int] | None]:
    """Rewind the run directory to ``step_dir``; (attempt number, the (weights dir, version) engines load or None).

    Every resume appends a line to ``RUN_DIR/resumes.jsonl``; its attempt number
    prefixes the new trajectory ids (``r{n}.g{k}-{j}``).
    """
    from megarl.checkpoint import link_or_copy_tree, read_manifest, remove_temp_dirs, rewind_run_logs

    manifest = read_manifest(step_dir)
    remove_temp_dirs(run_dir / "checkpoints")
    rewind_run_logs(run_dir, manifest)
    for stale in ("weights", "dedicated"):  # the killed run's working files
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    resumes = run_dir / "resumes.jsonl"
    attempt = 1 + (len(resumes.read_text().splitlines()) if resumes.is_file() else 0)
    with resumes.open("a") as f:
        f.write(json.dumps({"attempt": attempt, "checkpoint": str(step_dir), "step": manifest["step"],
                            "version": manifest["version"], "time": time.time()}) + "\n")
    version = int(state["version"])
    if version == 0:
        return attempt, None
    weights = run_dir / "weights" / f"v{version}"  # the publisher owns it from here: deleted at the next publish
    link_or_copy_tree(step_dir / "engine_weights", weights)
    return attempt, (str(weights), version)


@dataclass
class RunInputs:
    """What a run reads before it starts: the tokenizer and the prompts (checked before anything is written)."""

    tokenizer: RunTokenizer
    dataset: PromptDataset
    eval_dataset: PromptDataset | None


def load_inputs(cfg: MegaRLConfig, vocab_size: int) -> RunInputs:
    """The run's tokenizer, training prompts and evaluation prompts; bad input fails here, naming the fix."""
    tokenizer = RunTokenizer.load(cfg.model, cfg.rollout, cfg.data, vocab_size=vocab_size)
    dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed, vocab_size=vocab_size)
    eval_dataset = None
    if cfg.eval.path:
        eval_dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed, vocab_size=vocab_size,
                                                 path=cfg.eval.path, shuffle=False)
    elif cfg.eval.every:
        log.warning("eval.every=%d has no effect: eval.path is empty (no evaluation in this run)", cfg.eval.every)
    return RunInputs(tokenizer, dataset, eval_dataset)


def _eval_workflow(cfg: MegaRLConfig, tokenizer: RunTokenizer):
    """The run's workflow with the evaluation's temperature and response length."""
    rollout = dataclasses.replace(cfg.rollout, temperature=cfg.eval.temperature,
                                  max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
    return _workflow(dataclasses.replace(cfg, rollout=rollout), tokenizer)


async def _train_async(cfg: MegaRLConfig, run_dir: Path, ckpt: Path, inputs: RunInputs, wrap_strategy=None,
                       resume_from: Path | None = None) -> dict:
    from megarl.checkpoint import Checkpointer, load_file, load_rank_state, restore_rng, run_settings
    from megarl.controller import Controller
    from megarl.publish import make_publisher
    from megarl.rewards.service import RewardService
    from megarl.rollout.client import launch_engine_process, stop_engine_process
    from megarl.rollout.supervisor import EngineSupervisor
    from megarl.run_log import RunLogger
    from recovery import registry
    from recovery.base import RecoveryContext

    state = None
    engine_weights = (str(ckpt), 0)
    attempt = 0
    if resume_from is not None:
        state = load_file(resume_from / "controller.pt")
        attempt, weights = _prepare_resume(run_dir, resume_from, state)
        engine_weights = weights or engine_weights
    rewards = RewardService(cfg.reward.fn, n_workers=cfg.reward.n_workers, timeout_s=cfg.reward.timeout_s,
                            memory_mb=cfg.reward.memory_mb, on_failure=cfg.reward.on_failure)
    scorer = TrajectoryScorer(inputs.tokenizer, rewards)
    engine_starts: list[asyncio.Task] = []
    supervisor = None
    launches = [0] * cfg.rollout.n_engines
    try:
        def start_engine(i: int):
            # always the base checkpoint (an engine may read its start directory later); the supervisor
            # then loads the current weights (engine_weights, after a resume)
            port = cfg.rollout.base_port + i if cfg.rollout.base_port else None
            log_name = f"engine{i}.log" if not launches[i] else f"engine{i}.restart{launches[i]}.log"
            launches[i] += 1
            return launch_engine_process(str(ckpt), cfg.rollout.backend, port,
                                         extra_args=["--dtype", cfg.model.dtype],  # the trainer's precision
                                         kv_cache_gb=cfg.rollout.kv_cache_gb, cpu_threads=cfg.rollout.cpu_threads,
                                         log_path=str(run_dir / log_name))

        from megarl.launch.roles import current_role

        remote = current_role().engine_addrs
        if remote:  # started by a launcher on other nodes: connect to them
            engine_starts = [asyncio.create_task(connect_engine(addr)) for addr in remote]
        else:  # engines start (tens of seconds each) while the trainer builds below
            engine_starts = [asyncio.create_task(asyncio.to_thread(start_engine, i))
                             for i in range(cfg.rollout.n_engines)]
        trainer = build_trainer(cfg, ckpt)
        channel = None
        if trainer.parallel.world_size > 1:
            from megarl.trainer.spmd import ControlChannel, DrivingTrainer

            channel = ControlChannel()
            trainer = DrivingTrainer(trainer, channel)
        started = await asyncio.gather(*engine_starts, return_exceptions=True)
        for r in started:
            if isinstance(r, BaseException):
                raise r
        supervisor = router = EngineSupervisor(
            started, launch=None if remote else start_engine, weights=engine_weights,
            health_interval_s=cfg.rollout.health_interval_s, health_timeout_s=cfg.rollout.health_timeout_s,
            max_restarts=cfg.rollout.max_engine_restarts, work_dir=run_dir)
        await router.start()
        weights_dir = run_dir / "weights"

        publisher = make_publisher(cfg, trainer, router, weights_dir)

        controller_ref: dict = {}

        def live_versions() -> set[int]:
            c = controller_ref["c"]
            vs = {c.version}
            for t in c.buffer.live_trajectories():
                vs |= t.policy_versions()
            return vs

        ctx = RecoveryContext(trainer=getattr(trainer, "trainer", trainer), loss_cfg=cfg.loss,
                              live_versions=live_versions,
                              live_trajectories=lambda: controller_ref["c"].buffer.live_trajectories(),
                              run_dir=str(run_dir), checkpoint_dir=str(ckpt), eta=cfg.rollout.eta,
                              publish_every=cfg.trainer.publish_every)
        strategy = registry.build(cfg.recovery, ctx)
        if wrap_strategy is not None:
            strategy = wrap_strategy(strategy)
        if channel is not None:
            from megarl.trainer.spmd import DrivingStrategy

            strategy = DrivingStrategy(strategy, channel)
        checkpointer = Checkpointer(run_dir, trainer, strategy, weights_dir, keep_last=cfg.logging.keep_last,
                                    run=run_settings(cfg, trainer.parallel.world_size, trainer.hf_config))
        wandb = ({"project": cfg.logging.wandb_project, "config": to_dict(cfg)} if cfg.logging.wandb else None)
        logger = RunLogger(run_dir, cfg.trainer.total_steps, cfg.logging.tensorboard, cfg.logging.progress,
                           wandb=wandb)
        workflows = [_workflow(cfg, inputs.tokenizer)]
        evaluator = None
        if inputs.eval_dataset is not None:
            workflows.append(_eval_workflow(cfg, inputs.tokenizer))
            evaluator = Evaluator(inputs.eval_dataset.prompts(), workflows[-1], scorer,
                                  n_samples=cfg.eval.n_samples, pass_threshold=cfg.eval.pass_threshold)
        # built before any resume loads a checkpoint: the KL reference is the run's initial weights
        objective = loss_fn_factory_for_run(cfg, getattr(trainer, "trainer", trainer))
        controller = Controller(cfg, trainer=trainer, router=router, rewards=scorer, dataset=inputs.dataset,
                                workflow=workflows[0], strategy=strategy,
                                publisher=publisher, loss_fn_factory=objective,
                                advantages=advantage_fn(cfg.advantage), on_step=logger.log,
                                checkpointer=checkpointer, journal=logger, evaluator=evaluator,
                                on_eval=logger.log_eval, tokenizer=inputs.tokenizer)
        controller_ref["c"] = controller
        try:
            if state is not None:
                t0 = time.perf_counter()
                if channel is not None:
                    trainer.load_rank_states(str(resume_from), strategy)
                else:
                    load_rank_state(resume_from, trainer, strategy)
                controller.load_state_dict(state, id_prefix=f"r{attempt}.")
                checkpointer.last_step = controller.step
                restore_rng(state["rng"])
                log.info("resumed %s at step %d, version %d (engines at %d) in %.1f s", resume_from,
                         controller.step, trainer.version, controller.version, time.perf_counter() - t0)
            await controller.train(cfg.trainer.total_steps)
            trainer.save_hf_checkpoint(str(run_dir / "final"))
            inputs.tokenizer.save(run_dir / "final")  # so final/ serves and loads with AutoTokenizer as is
        finally:
            logger.close()
            strategy.close()
            publisher.close()
            for w in workflows:
                w.close()
            if channel is not None:  # also after an error: followers must not wait for events forever
                trainer.stop_followers()
        shutil.rmtree(weights_dir, ignore_errors=True)
        return {"steps": controller.step, "version": trainer.version}
    finally:
        rewards.close()
        if supervisor is not None:
            await supervisor.close()
        else:
            for r in await asyncio.gather(*engine_starts, return_exceptions=True):
                if not isinstance(r, BaseException) and r[0] is not None:
                    stop_engine_process(r[0])


def train(cfg: MegaRLConfig, wrap_strategy=None, resume: str | Path | None = None) -> Path:
    """Run the loop; ``wrap_strategy(strategy) -> strategy`` may wrap the recovery strategy (verification).

    ``resume`` (default ``logging.resume``): a run directory to continue from its
    newest valid checkpoint (the run keeps writing there; ``logging.output_dir`` is ignored).

    Every input is checked before the run directory is made (or, resuming,
    before anything in it changes), so bad input leaves nothing half-written behind.
    """
    from megarl.rewards import resolve_reward_fn, reward_kwargs

    from megarl.launch.roles import current_role

    role = current_role()
    if role.role != "trainer":
        serve_role(cfg, role)
        return Path(".")
    rank, world = _init_ranks()
    status: list = [None, None]
    resume = resume or cfg.logging.resume or None
    resume_from = None
    if rank == 0:
        try:
            if resume is not None:
                from megarl.checkpoint import find_latest_checkpoint

                resume_from = find_latest_checkpoint(resume)
                cfg.logging.output_dir = str(resume)
            ckpt = ensure_checkpoint(cfg)
            hf = json.loads((ckpt / "config.json").read_text())
            validate(cfg, hf)
            refuse_unwired(cfg)
            if resume_from is not None:
                from megarl.checkpoint import check_run_settings, read_manifest

                check_run_settings(cfg, read_manifest(resume_from), resume_from, world, hf)
            reward_kwargs(resolve_reward_fn(cfg.reward.fn), cfg.reward.fn)
            inputs = load_inputs(cfg, int(hf["vocab_size"]))
            if resume_from is not None:
                run_dir = Path(resume)
            else:
                run_dir = make_run_dir(cfg)
                save_config(cfg, run_dir / "config.yaml")
            status = ["ok", str(run_dir)]
        except MegarlError as e:
            status = ["error", f"{type(e).__name__}: {e}"]
            _share(status, world)
            raise
    _share(status, world)
    if rank != 0:
        if status[0] != "ok":
            raise MegarlError(f"rank 0 refused the run: {status[1]}")
        _follow(cfg, Path(cfg.model.checkpoint), Path(status[1]))
        return Path(status[1])
    summary = asyncio.run(_train_async(cfg, run_dir, ckpt, inputs, wrap_strategy, resume_from))
    (run_dir / "summary.json").write_text(json.dumps(summary) + "\n")
    return run_dir


def _init_ranks() -> tuple[int, int]:
    """(rank, world size) of the trainer ranks; a plain process is rank 0 of 1."""
    from megarl.launch.mpi_bootstrap import bootstrap_env_from_mpi

    bootstrap_env_from_mpi()  # under mpirun: RANK/WORLD_SIZE/MASTER_* from MPI (no-op otherwise)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    from megarl.trainer.parallel import init_distributed

    init_distributed()
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _share(status: list, world: int) -> None:
    """Rank 0's go/no-go (and run directory) to every trainer rank."""
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(status, src=0)


def main(argv: list[str] | None = None) -> int:
    from megarl.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
