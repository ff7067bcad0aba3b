"""Build a run from a config and train: the one entry point behind `megarl train` and the launchers.

``python -m megarl.train --config X [key=value ...]`` is the same as ``megarl train``.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from megarl.config import MegaRLConfig, load_config, save_config
from megarl.errors import ConfigError, MegarlError

log = logging.getLogger("megarl.train")


def make_run_dir(cfg: MegaRLConfig) -> Path:
    if cfg.logging.output_dir:
        run_dir = Path(cfg.logging.output_dir)
    else:
        run_dir = Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
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
    max_len = int(hf.get("max_position_embeddings", 0))
    need = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if max_len and need > max_len:
        raise ConfigError(f"data.max_prompt_len + rollout.max_new_tokens = {need} exceeds the model's "
                          f"max_position_embeddings {max_len}; lower one of them")


def make_loss_fn_factory(loss_cfg):
    from megarl.losses import loss_normalizer, policy_loss

    def factory(batch, anchor):
        ref = batch.logp_anchor if batch.logp_anchor is not None else batch.logp_behav
        # the global denominator, so that micro-batch losses add up to the full-batch loss
        normalizer = loss_normalizer(ref, batch.logp_behav, batch.loss_mask, loss_cfg)

        def loss_fn(logp_theta, mb, _counts=None):
            if anchor.from_theta is not None:
                logp_anchor = anchor.from_theta(logp_theta.detach(), mb)
            else:
                logp_anchor = mb.logp_anchor
            return policy_loss(logp_theta, logp_anchor, mb.logp_behav, mb.advantages, mb.loss_mask,
                               loss_cfg, normalizer=normalizer)

        return loss_fn

    return factory


def make_advantage_fn(adv_cfg):
    from megarl.advantages import compute_advantages

    def assign(trajs):
        gid = trajs[0].group_id
        adv = compute_advantages({gid: [t.reward for t in trajs]}, estimator=adv_cfg.estimator,
                                 std_normalize=adv_cfg.std_normalize, eps=adv_cfg.eps)[gid]
        for t, a in zip(trajs, adv):
            t.advantage = float(a)

    return assign


class DiskPublisher:
    """Weights to engines through safetensors on (shared) disk: export, then load."""

    def __init__(self, trainer, router, weights_dir: Path) -> None:
        self.trainer = trainer
        self.router = router
        self.weights_dir = weights_dir

    async def prepare(self, version: int) -> None:
        await asyncio.to_thread(self.trainer.save_hf_checkpoint, str(self.weights_dir / f"v{version}"))

    async def apply(self, version: int) -> None:
        current = self.weights_dir / f"v{version}"
        await self.router.update_weights_from_disk(str(current), version)
        for old in self.weights_dir.glob("v*"):
            if old != current:
                shutil.rmtree(old, ignore_errors=True)


async def _connect_engine(addr: str, timeout_s: float = 600.0):
    """(None, client) for an engine another process started; waits until it is healthy."""
    from megarl.errors import EngineError
    from megarl.rollout.client import EngineClient

    client = EngineClient(addr if addr.startswith("http") else f"http://{addr}")
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.health()
            return None, client
        except EngineError:
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(f"engine at {addr} did not become healthy within {timeout_s:.0f} s") from None
            await asyncio.sleep(2.0)


def _serve_role(cfg: MegaRLConfig, role) -> None:
    """A process launched for a server role of a plan."""
    if role.role == "engine":
        from megarl.rollout.server import serve

        asyncio.run(serve(cfg.model.checkpoint, cfg.rollout.backend, host="0.0.0.0", port=role.server_port))
        return
    raise ConfigError("a dedicated old-logit scorer on its own nodes (MEGARL_ROLE=dedicated) is not supported yet: "
                      "with recovery.name=dedicated the scorer runs as a process beside trainer rank 0; "
                      "set placement.dedicated_nodes=0")


def build_trainer(cfg: MegaRLConfig, ckpt: Path):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(str(ckpt), tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep,
                           lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
                           adam_eps=cfg.trainer.adam_eps, grad_clip=cfg.trainer.grad_clip,
                           micro_batch_tokens=cfg.trainer.micro_batch_tokens, seed=cfg.trainer.seed,
                           use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                           lr_warmup_steps=cfg.trainer.lr_warmup_steps, lr_decay=cfg.trainer.lr_decay,
                           total_steps=cfg.trainer.total_steps, min_lr=cfg.trainer.min_lr)


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
        follow(trainer, strategy, channel, make_loss_fn_factory(cfg.loss), view)
    finally:
        strategy.close()


async def _train_async(cfg: MegaRLConfig, run_dir: Path, ckpt: Path, dataset, wrap_strategy=None) -> dict:
    from megarl.controller import Controller
    from megarl.rewards.service import RewardService
    from megarl.rollout.client import launch_engine_process, stop_engine_process
    from megarl.rollout.router import EngineRouter
    from megarl.run_log import RunLogger
    from megarl.workflows import build_workflow
    from recovery import registry
    from recovery.base import RecoveryContext

    rewards = RewardService(cfg.reward.fn, n_workers=cfg.reward.n_workers, timeout_s=cfg.reward.timeout_s,
                            memory_mb=cfg.reward.memory_mb, on_failure=cfg.reward.on_failure)
    engine_starts: list[asyncio.Task] = []
    try:
        def start_engine(i: int):
            port = cfg.rollout.base_port + i if cfg.rollout.base_port else None
            return launch_engine_process(str(ckpt), cfg.rollout.backend, port,
                                         env={"VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gb)},
                                         log_path=str(run_dir / f"engine{i}.log"))

        from megarl.launch.roles import current_role

        remote = current_role().engine_addrs
        if remote:  # started by a launcher on other nodes: connect to them
            engine_starts = [asyncio.create_task(_connect_engine(addr)) for addr in remote]
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
        router = EngineRouter([r[1] for r in started])
        weights_dir = run_dir / "weights"

        publisher = DiskPublisher(trainer, router, weights_dir)

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
        logger = RunLogger(run_dir, cfg.trainer.total_steps, cfg.logging.tensorboard, cfg.logging.progress)
        controller = Controller(cfg, trainer=trainer, router=router, rewards=rewards, dataset=dataset,
                                workflow=build_workflow("single_turn", cfg), strategy=strategy,
                                publisher=publisher, loss_fn_factory=make_loss_fn_factory(cfg.loss),
                                advantages=make_advantage_fn(cfg.advantage), on_step=logger.log)
        controller_ref["c"] = controller
        try:
            await controller.train(cfg.trainer.total_steps)
        finally:
            logger.close()
            strategy.close()
            await router.close()
        trainer.save_hf_checkpoint(str(run_dir / "final"))
        if channel is not None:
            trainer.stop_followers()
        shutil.rmtree(weights_dir, ignore_errors=True)
        return {"steps": controller.step, "version": trainer.version}
    finally:
        rewards.close()
        for r in await asyncio.gather(*engine_starts, return_exceptions=True):
            if not isinstance(r, BaseException) and r[0] is not None:
                stop_engine_process(r[0])


def train(cfg: MegaRLConfig, wrap_strategy=None) -> Path:
    """Run the loop; ``wrap_strategy(strategy) -> strategy`` may wrap the recovery strategy (verification).

    Every input is checked before the run directory is made, so bad input
    leaves nothing half-written behind.
    """
    from megarl.data import PromptDataset
    from megarl.rewards.service import resolve_reward_fn

    from megarl.launch.roles import current_role

    role = current_role()
    if role.role != "trainer":
        _serve_role(cfg, role)
        return Path(".")
    rank, world = _init_ranks()
    status: list = [None, None]
    if rank == 0:
        try:
            ckpt = ensure_checkpoint(cfg)
            hf = json.loads((ckpt / "config.json").read_text())
            validate(cfg, hf)
            resolve_reward_fn(cfg.reward.fn)
            dataset = PromptDataset.from_config(cfg.data, seed=cfg.trainer.seed, vocab_size=int(hf["vocab_size"]))
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
    summary = asyncio.run(_train_async(cfg, run_dir, ckpt, dataset, wrap_strategy))
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
