"""Assemble a run from its config: engines, trainer, strategy, controller, each built once and injected.

The recovery strategies are plug-ins (package ``recovery``, which imports
megarl). This is the one module of megarl that imports them
(tests/unit/test_dependencies.py keeps it so): the config loader gets their
config classes from :func:`load_run_config`, the commands get their names from
:func:`strategy_names`, ``megarl verify-recovery`` and ``megarl bench`` get the
verifier (``VerifyingStrategy``), a launched scorer role gets
:func:`serve_dedicated_role`, and a training run gets its strategy from
:func:`build_run` or :func:`run_follower`.

Order of :func:`build_run`: the engines start in the background (tens of
seconds each) while the trainer builds; the replay buffer and the engines'
published version come before the strategy, whose context reads both, and
the controller comes last, taking everything. What a step of the building
opens is closed, in reverse order, when the run closes or when a later step
fails.
"""
from __future__ import annotations

import asyncio
import dataclasses
import shutil
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megarl.checkpoint.rank_state import SingleRankStates
from megarl.checkpoint.resume import ResumePoint, restore
from megarl.checkpoint.run_checkpoint import Checkpointer
from megarl.checkpoint.settings import run_settings
from megarl.config import MegaRLConfig, load_config
from megarl.config.loader import describe, to_dict
from megarl.launch.roles import current_role
from megarl.loop.buffer import PublishedVersion, ReplayBuffer
from megarl.loop.controller import Controller
from megarl.loop.evaluation import Evaluator
from megarl.loop.follower import FollowerView, follow
from megarl.loop.run_log import RunLogger
from megarl.loop.spmd import ControlChannel, DrivingStrategy, DrivingTrainer
from megarl.losses.advantages import advantage_fn
from megarl.losses.objective import loss_fn_factory, loss_fn_factory_for_run
from megarl.preflight import RunSetup
from megarl.rewards.overlong import overlong_penalty
from megarl.rewards.scorer import TrajectoryScorer
from megarl.rewards.service import RewardService
from megarl.rollout.base import logprob_temperature
from megarl.rollout.client import connect_engine, launch_engine_process, stop_engine_process
from megarl.rollout.engine_pool import PooledEngines, engine_launch_kwargs
from megarl.rollout.publish import make_publisher
from megarl.rollout.supervisor import EngineSupervisor
from megarl.tokenizer import RunTokenizer
from megarl.trainer.base import TrainerProtocol
from megarl.trainer.megatron_trainer import MegatronTrainer
from megarl.trainer.parallel import timed_out_collective
from megarl.workflows import build_workflow
from recovery import _negative_controls as negative_controls
from recovery import registry
from recovery._calibration_probe import CalibrationProbe
from recovery.base import DelegatingStrategy, RecoveryContext, RecoveryStrategy
from recovery.dedicated import serve_role as serve_dedicated_role
from recovery.verifier import DEFAULT_TOL, VerifyingStrategy

__all__ = ["DEFAULT_TOL", "CalibrationProbe", "DelegatingStrategy", "Run", "VerifyingStrategy", "build_run",
           "build_trainer", "describe_config", "load_run_config", "negative_controls", "run_follower",
           "serve_dedicated_role", "strategy_configs", "strategy_names"]

#: ``wrap_strategy(strategy) -> strategy``: what verification and benchmarking put around the run's strategy
StrategyWrapper = Callable[[RecoveryStrategy], RecoveryStrategy]


# -- the strategies as the config and the commands see them ----------------------------------
def strategy_configs() -> dict[str, type]:
    """Recovery strategy name -> its config dataclass (the options under ``recovery.<name>.*``)."""
    return registry.config_classes()


def strategy_names(spec: str) -> list[str]:
    """``"all"`` or a comma-separated list of strategy names, checked against the registry."""
    return registry.resolve_names(spec)


def load_run_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MegaRLConfig:
    """The run config from a YAML file and dotted overrides, with every registered strategy's options."""
    return load_config(path, overrides, strategies=strategy_configs())


def describe_config() -> list[str]:
    """Every config key with its default and meaning (``megarl train --help-config``)."""
    return describe(strategy_configs())


# -- pieces ------------------------------------------------------------------------------------
def build_trainer(cfg: MegaRLConfig, ckpt: Path) -> MegatronTrainer:
    return MegatronTrainer(str(ckpt), tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                           lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
                           adam_eps=cfg.trainer.adam_eps, grad_clip=cfg.trainer.grad_clip,
                           micro_batch_tokens=cfg.trainer.micro_batch_tokens, seed=cfg.trainer.seed,
                           use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                           lr_warmup_steps=cfg.trainer.lr_warmup_steps, lr_decay=cfg.trainer.lr_decay,
                           total_steps=cfg.trainer.total_steps, min_lr=cfg.trainer.min_lr, dtype=cfg.model.dtype,
                           sequence_parallel=cfg.parallel.sequence_parallel,
                           temperature=logprob_temperature(cfg.rollout.temperature),
                           batch_invariant=cfg.rollout.batch_invariant, recompute=cfg.trainer.recompute,
                           allow_local_spec=cfg.model.allow_local_spec, packing=cfg.trainer.packing)


def _workflow(cfg: MegaRLConfig, tokenizer: RunTokenizer):
    if cfg.rollout.workflow == "multi_turn":
        return build_workflow("multi_turn", cfg, tokenizer, env=cfg.rollout.tool_env,
                              max_turns=cfg.rollout.max_turns, max_response_len=cfg.rollout.max_new_tokens)
    return build_workflow(cfg.rollout.workflow, cfg, tokenizer)


def _eval_workflow(cfg: MegaRLConfig, tokenizer: RunTokenizer):
    """The run's workflow with the evaluation's temperature, response length and agent (eval.agent_fn)."""
    rollout = dataclasses.replace(cfg.rollout, temperature=cfg.eval.temperature,
                                  max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens)
    agent = dataclasses.replace(cfg.agent, fn=cfg.eval.agent_fn or cfg.agent.fn)
    return _workflow(dataclasses.replace(cfg, rollout=rollout, agent=agent), tokenizer)


class _EngineStarts:
    """The run's engines, started (or, launched on other nodes or kept in a pool, connected to) in the background.

    Until :meth:`hand_over` gives them to a supervisor, :meth:`close` stops every engine process that came up.
    Pooled engines (megarl/rollout/engine_pool.py) are first reset to the base checkpoint at version 0, where a
    fresh engine starts; the pool, not the run, stops them.
    """

    def __init__(self, cfg: MegaRLConfig, ckpt: Path, run_dir: Path, remote: tuple[str, ...],
                 pool: PooledEngines | None = None) -> None:
        self.cfg, self.ckpt, self.run_dir = cfg, ckpt, run_dir
        self.remote = remote
        self.pool = None if remote else pool
        self.launches = [0] * cfg.rollout.n_engines
        if remote:  # started by a launcher on other nodes: connect to them
            self.tasks = [asyncio.create_task(connect_engine(addr)) for addr in remote]
        elif self.pool is not None:
            self.pool.use(cfg, ckpt)
            self.tasks = [asyncio.create_task(self._pooled(i)) for i in range(cfg.rollout.n_engines)]
        else:
            self.tasks = [asyncio.create_task(asyncio.to_thread(self.launch, i)) for i in range(cfg.rollout.n_engines)]
        self.handed_over = False

    async def _pooled(self, i: int):
        proc, client = await asyncio.to_thread(self.pool.engine, i)
        await client.update_weights_from_disk(str(self.ckpt), 0)  # the previous run left its last version there
        return proc, client

    def launcher(self):
        """The supervisor's ``launch``: None (engines elsewhere: a dead one is dropped), the pool's, or ours."""
        return None if self.remote else self.pool.relaunch if self.pool is not None else self.launch

    def launch(self, i: int):
        """(process, client) of engine ``i`` on the base checkpoint (an engine may read its start directory
        later); the supervisor then loads the current weights into it. Blocking: run in a thread."""
        log_name = f"engine{i}.log" if not self.launches[i] else f"engine{i}.restart{self.launches[i]}.log"
        self.launches[i] += 1
        return launch_engine_process(**engine_launch_kwargs(self.cfg, self.ckpt, i),
                                     log_path=str(self.run_dir / log_name))

    async def started(self) -> list:
        """Every engine's (process or None, client); the first failure is raised."""
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def hand_over(self) -> None:
        self.handed_over = True

    async def close(self) -> None:
        if self.handed_over:
            return
        for r in await asyncio.gather(*self.tasks, return_exceptions=True):
            if not isinstance(r, BaseException) and r[0] is not None:
                stop_engine_process(r[0])


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Run:
    """A built run. ``async with run:`` closes what building opened, in reverse order."""

    cfg: MegaRLConfig
    run_dir: Path
    #: what the loop drives (the MegatronTrainer, or rank 0's DrivingTrainer with several ranks)
    trainer: TrainerProtocol
    strategy: Any
    controller: Controller
    checkpointer: Checkpointer
    #: writes and reads every trainer rank's checkpoint files (SingleRankStates or the DrivingTrainer)
    rank_states: Any
    tokenizer: RunTokenizer
    #: where published versions are written for the engines (megarl/rollout/publish.py)
    weights_dir: Path
    closing: AsyncExitStack

    def restore(self, point: ResumePoint) -> None:
        """Continue from a checkpoint (megarl/checkpoint/resume.py): call before :meth:`Controller.train`."""
        restore(point, controller=self.controller, rank_states=self.rank_states, strategy=self.strategy,
                checkpointer=self.checkpointer)

    def save_final(self) -> None:
        """The trained policy as ``RUN_DIR/final``: HF weights and the run's tokenizer (loads with AutoTokenizer)."""
        self.trainer.save_hf_checkpoint(str(self.run_dir / "final"))
        self.tokenizer.save(self.run_dir / "final")

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if isinstance(self.trainer, DrivingTrainer) and timed_out_collective(exc) is not None:
            self.trainer.followers_lost = True  # a trainer rank is gone: no collective waits for it again
        await self.closing.aclose()
        if exc_type is None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


async def build_run(cfg: MegaRLConfig, setup: RunSetup, resume: ResumePoint | None = None,
                    wrap_strategy: StrategyWrapper | None = None, engine_pool: PooledEngines | None = None) -> Run:
    """Build every piece of a run on trainer rank 0 (module doc); ``resume``: the engines start at its weights;
    ``engine_pool``: the engines come from it instead of being started for this run alone."""
    run_dir, ckpt, inputs = setup.run_dir, setup.checkpoint, setup.inputs
    async with AsyncExitStack() as stack:
        rewards = RewardService(cfg.reward.fn, n_workers=cfg.reward.n_workers, timeout_s=cfg.reward.timeout_s,
                                memory_mb=cfg.reward.memory_mb, on_failure=cfg.reward.on_failure)
        stack.callback(rewards.close)
        scorer = TrajectoryScorer(inputs.tokenizer, rewards, length_penalty=overlong_penalty(cfg))
        remote = current_role().engine_addrs
        engines = _EngineStarts(cfg, ckpt, run_dir, remote, engine_pool)
        stack.push_async_callback(engines.close)

        trainer = build_trainer(cfg, ckpt)  # while the engines start
        driver: TrainerProtocol = trainer
        rank_states: Any = SingleRankStates(trainer)
        channel = None
        if trainer.parallel.world_size > 1:
            channel = ControlChannel()
            driver = rank_states = DrivingTrainer(trainer, channel)
            stack.callback(driver.stop_followers)  # also after an error: followers must not wait for events forever

        supervisor = EngineSupervisor(
            await engines.started(), launch=engines.launcher(),
            weights=(resume and resume.engine_weights) or (str(ckpt), 0),
            health_interval_s=cfg.rollout.health_interval_s, health_timeout_s=cfg.rollout.health_timeout_s,
            max_restarts=cfg.rollout.max_engine_restarts, work_dir=run_dir,
            publish_timeout_s=cfg.rollout.publish_timeout_s, generate_timeout_s=cfg.rollout.generate_timeout_s)
        engines.hand_over()
        stack.push_async_callback(supervisor.close)
        await supervisor.start()
        weights_dir = run_dir / "weights"
        publisher = make_publisher(cfg, driver, supervisor, weights_dir)
        stack.callback(publisher.close)

        buffer = ReplayBuffer(cfg.trainer.batch_size, cfg.rollout.eta)
        published = PublishedVersion()
        ctx = RecoveryContext(trainer=trainer, loss_cfg=cfg.loss,
                              live_versions=lambda: buffer.live_versions(published.value),
                              live_trajectories=buffer.live_trajectories, run_dir=str(run_dir),
                              checkpoint_dir=str(ckpt), eta=cfg.rollout.eta, publish_every=cfg.trainer.publish_every)
        strategy = registry.build(cfg.recovery, ctx)
        if wrap_strategy is not None:
            strategy = wrap_strategy(strategy)
        if channel is not None:
            strategy = DrivingStrategy(strategy, channel)
        stack.callback(strategy.close)

        checkpointer = Checkpointer(run_dir, driver, strategy, weights_dir, keep_last=cfg.logging.keep_last,
                                    run=run_settings(cfg, trainer.parallel.world_size, trainer.hf_config),
                                    rank_states=rank_states)
        wandb = {"project": cfg.logging.wandb_project, "config": to_dict(cfg)} if cfg.logging.wandb else None
        logger = RunLogger(run_dir, cfg.trainer.total_steps, cfg.logging.tensorboard, cfg.logging.progress,
                           wandb=wandb, summary_every_s=cfg.logging.summary_every_s)
        stack.callback(logger.close)
        workflow = _workflow(cfg, inputs.tokenizer)
        stack.callback(workflow.close)  # an agent's tool workers
        if hasattr(workflow, "aclose"):  # an agent endpoint listening on this loop
            stack.push_async_callback(workflow.aclose)
        if cfg.agent.rows_from_service:  # no episode starts the endpoint: the service's rows start them
            await workflow.serve_rows(inputs.dataset)
        evaluator = None
        if inputs.eval_dataset is not None:
            eval_workflow = _eval_workflow(cfg, inputs.tokenizer)
            stack.callback(eval_workflow.close)
            if hasattr(eval_workflow, "aclose"):
                stack.push_async_callback(eval_workflow.aclose)
            evaluator = Evaluator(inputs.eval_dataset.prompts(), eval_workflow, scorer.without_length_penalty(),
                                  n_samples=cfg.eval.n_samples, pass_threshold=cfg.eval.pass_threshold)
        # built before any resume loads a checkpoint: the KL reference is the run's initial weights
        objective = loss_fn_factory_for_run(cfg, trainer)
        controller = Controller(cfg, trainer=driver, router=supervisor, buffer=buffer, published=published,
                                rewards=scorer, dataset=inputs.dataset, workflow=workflow,
                                strategy=strategy, publisher=publisher, loss_fn_factory=objective,
                                advantages=advantage_fn(cfg.advantage), on_step=logger.log,
                                checkpointer=checkpointer, journal=logger, evaluator=evaluator,
                                on_eval=logger.log_eval, tokenizer=inputs.tokenizer)
        return Run(cfg, run_dir, driver, strategy, controller, checkpointer, rank_states, inputs.tokenizer,
                   weights_dir, stack.pop_all())


def run_follower(cfg: MegaRLConfig, run_dir: Path) -> None:
    """A trainer rank other than 0: build the same trainer and strategy, then replay rank 0's calls until it stops."""
    ckpt = Path(cfg.model.checkpoint)
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
