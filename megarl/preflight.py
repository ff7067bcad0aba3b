"""What a run checks and reads before anything starts (trainer rank 0, in :func:`megarl.train.train`).

:func:`preflight` resolves the policy checkpoint, checks the settings against
each other and against the model, checks a resume against the checkpoint it
continues, loads the tokenizer and the prompts, and only then makes the run
directory (or, resuming, reuses it unchanged): bad input fails here with one
error naming the fix, and leaves nothing half-written behind.
"""
from __future__ import annotations

import copy
import datetime as _dt
import importlib.util
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megarl.agents.service_rows import ServiceRows
from megarl.checkpoint.run_checkpoint import find_latest_checkpoint, read_manifest
from megarl.checkpoint.settings import check_run_settings
from megarl.config import MegaRLConfig, save_config
from megarl.data import PromptDataset
from megarl.errors import ConfigError
from megarl.losses.advantages import check_pos_weight
from megarl.models.hf_config import is_moe
from megarl.models.tiny import load_model_yaml, write_tiny_checkpoint
from megarl.platform import batch_invariant
from megarl.platform.cpu_affinity import check_affinity
from megarl.rewards import resolve_reward_fn, reward_kwargs
from megarl.rewards.code import prepare_sandbox
from megarl.rollout.base import engine_options, truncates_sampling
from megarl.rollout.engine_shards import refuse_quantized
from megarl.rollout.generate_deadline import check_generate_timeout
from megarl.tokenizer import RunTokenizer
from megarl.workflows.agent import load_agent
from megarl.workflows.agent_checks import check_agent_config

log = logging.getLogger("megarl.preflight")


@dataclass
class RunInputs:
    """What a run reads before it starts: the tokenizer and the prompts (checked before anything is written)."""

    tokenizer: RunTokenizer
    dataset: PromptDataset | ServiceRows
    eval_dataset: PromptDataset | None


@dataclass
class RunSetup:
    """A run that passed its checks: where it writes, what it trains, what it reads."""

    run_dir: Path
    #: the policy's HF checkpoint directory (the engines start from it) and its config.json
    checkpoint: Path
    hf_config: dict
    inputs: RunInputs
    #: the checkpoint a resumed run continues from (None: a new run)
    resume_from: Path | None = None


def preflight(cfg: MegaRLConfig, resume: str | Path | None, world_size: int) -> RunSetup:
    """Check everything, then make the run directory; ``resume``: a run directory to continue."""
    if resume is not None:
        cfg.logging.output_dir = str(resume)
    ckpt, hf, inputs, resume_from = _check_all(cfg, resume, world_size, ensure_checkpoint(cfg))
    if resume_from is not None:
        run_dir = Path(resume)
    else:
        run_dir = make_run_dir(cfg)
        save_config(cfg, run_dir / "config.yaml")
    return RunSetup(run_dir, ckpt, hf, inputs, resume_from)


def _check_all(cfg: MegaRLConfig, resume: str | Path | None, world_size: int, ckpt: Path):
    """Every check of a run before it writes anything (`megarl train` and `megarl train --check`)."""
    resume_from = find_latest_checkpoint(resume) if resume is not None else None
    hf = json.loads((ckpt / "config.json").read_text())
    check_config(cfg, hf)
    prepare_sandbox(cfg)  # no isolation for sandboxed code on this host: no run, unless explicitly opted out
    batch_invariant.check_host(cfg)
    if resume_from is not None:
        check_run_settings(cfg, read_manifest(resume_from), resume_from, world_size, hf)
    inputs = load_inputs(cfg, int(hf["vocab_size"]))
    return ckpt, hf, inputs, resume_from


def check_config(cfg: MegaRLConfig, hf: dict) -> None:
    """The checks of the settings against the model's config.json fields alone: `megarl train`, `megarl plan` and
    `megarl launch` (before any process starts) all make them."""
    validate(cfg, hf)
    refuse_quantized(hf)  # engines load this checkpoint: a quantized one would load megarl's updates wrong
    refuse_unwired(cfg)
    reward_kwargs(resolve_reward_fn(cfg.reward.fn), cfg.reward.fn)


def check_only(cfg: MegaRLConfig) -> str:
    """`megarl train --check`: every check :func:`preflight` makes, nothing written (a tiny checkpoint that
    ``model.init_model`` would create goes to a temporary directory); returns a one-paragraph summary."""
    resume = cfg.logging.resume or None
    if resume is None and cfg.logging.output_dir:
        _refuse_an_earlier_run(Path(cfg.logging.output_dir))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(cfg.model.checkpoint)
        checked = cfg
        if cfg.model.checkpoint and not (ckpt / "config.json").is_file() and cfg.model.init_model:
            checked = copy.deepcopy(cfg)  # the run would write this checkpoint: the check reads a temporary one
            ckpt = write_tiny_checkpoint(cfg.model.init_model, Path(tmp) / "init_model", seed=cfg.model.init_seed)
            checked.model.checkpoint = str(ckpt)
        elif not (ckpt / "config.json").is_file():
            ckpt = ensure_checkpoint(cfg)  # raises, naming what is missing
        _, hf, inputs, resume_from = _check_all(checked, resume, cfg.placement.trainer_ranks, ckpt)
    n_rows = len(inputs.dataset) if isinstance(inputs.dataset, PromptDataset) else "served"
    return (f"megarl train --check: all checks passed (model {cfg.model.checkpoint}: {hf.get('model_type')}, "
            f"{hf.get('num_hidden_layers')} layers; {n_rows} training rows; reward {cfg.reward.fn}; recovery "
            f"{cfg.recovery.name}" + (f"; resumes from {resume_from}" if resume_from is not None else "") + ")")


def make_run_dir(cfg: MegaRLConfig) -> Path:
    if cfg.logging.output_dir:
        run_dir = Path(cfg.logging.output_dir)
    else:
        run_dir = Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    _refuse_an_earlier_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _refuse_an_earlier_run(run_dir: Path) -> None:
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*")):
        raise ConfigError(f"{run_dir} holds the checkpoints of an earlier run; continue it with "
                          f"`megarl train --config ... --resume {run_dir}` or choose another --output-dir")


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
        write_tiny_checkpoint(cfg.model.init_model, ckpt, seed=cfg.model.init_seed)
    elif cfg.model.init_model:
        check_init_model_matches(ckpt, cfg.model.init_model)
    return ckpt


#: config.json fields that make a checkpoint another model than a model YAML describes
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_init_model_matches(ckpt: Path, init_model: str) -> None:
    """An existing ``model.checkpoint`` is used as it is, whatever ``model.init_model`` says (a test or a user may
    point a config at another checkpoint on purpose); when the two describe different models, say so once, so a
    checkpoint left by an earlier run of another config is not taken for the one the YAML describes."""
    have = json.loads((ckpt / "config.json").read_text())
    want = load_model_yaml(init_model)
    differ = [f"{k} {have.get(k)} (the YAML: {want.get(k)})" for k in _SHAPE_FIELDS if have.get(k) != want.get(k)]
    if differ:
        log.warning("model.checkpoint %s exists and is used as it is, but it is not the model model.init_model=%s "
                    "describes: %s. It is written from model.init_model only when it does not exist: point "
                    "model.checkpoint at a new directory to get that model", ckpt, init_model, ", ".join(differ))


def validate(cfg: MegaRLConfig, hf: dict) -> None:
    """Inconsistent settings fail here, before anything starts."""
    for key, value in (("rollout.group_size", cfg.rollout.group_size),
                       ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)):
        if value < 1:  # no samples per prompt, or responses with no token to train on
            raise ConfigError(f"{key}={value} must be >= 1")
    if cfg.trainer.batch_size % cfg.rollout.group_size:
        raise ConfigError(f"trainer.batch_size={cfg.trainer.batch_size} must be a multiple of "
                          f"rollout.group_size={cfg.rollout.group_size} (batches hold whole groups)")
    if cfg.rollout.eta < 0:
        raise ConfigError(f"rollout.eta={cfg.rollout.eta} must be >= 0")
    if cfg.rollout.splice_at_tokens < 0 or (cfg.rollout.splice_at_tokens and cfg.rollout.eta < 1):
        raise ConfigError(f"rollout.splice_at_tokens={cfg.rollout.splice_at_tokens} with rollout.eta="
                          f"{cfg.rollout.eta}: a held turn waits for the next publish, which needs eta >= 1 "
                          f"(set rollout.eta >= 1, or rollout.splice_at_tokens=0 to turn holding off)")
    if cfg.loss.entropy_coef < 0:
        raise ConfigError(f"loss.entropy_coef={cfg.loss.entropy_coef} must be >= 0 (a negative bonus would push the "
                          f"policy to collapse onto one answer); 0 turns the bonus off")
    check_pos_weight(cfg.advantage.pos_weight)  # later, inside the loop, a group's failure only drops its samples
    if cfg.loss.entropy_target is not None:
        if cfg.loss.entropy_target <= 0:
            raise ConfigError(f"loss.entropy_target={cfg.loss.entropy_target} must be > 0 (nats per policy token), "
                              f"or null for a fixed loss.entropy_coef")
        lo, hi = cfg.loss.entropy_coef_min, cfg.loss.entropy_coef_max
        if cfg.loss.entropy_coef_step <= 0 or not 0 <= lo <= cfg.loss.entropy_coef <= hi:
            raise ConfigError(f"loss.entropy_target is set, so loss.entropy_coef_step={cfg.loss.entropy_coef_step} "
                              f"must be > 0 and 0 <= loss.entropy_coef_min={lo} <= loss.entropy_coef="
                              f"{cfg.loss.entropy_coef} <= loss.entropy_coef_max={hi} (the coefficient starts at "
                              f"loss.entropy_coef and stays within the two)")
    if not 0.0 <= cfg.reward.max_fail_frac <= 1.0:
        raise ConfigError(f"reward.max_fail_frac={cfg.reward.max_fail_frac} must be in [0, 1]")
    _check_overlong(cfg)
    if cfg.rollout.filter_groups and cfg.rollout.group_size == 1:
        raise ConfigError("rollout.filter_groups=true with rollout.group_size=1: a group of one sample always has "
                          "equal rewards, so every group would be filtered and no batch would ever form; set "
                          "rollout.group_size >= 2 or rollout.filter_groups=false")
    if cfg.rollout.max_concurrency < 1:
        raise ConfigError(f"rollout.max_concurrency={cfg.rollout.max_concurrency} must be >= 1 (requests in flight; "
                          f"with none no sample is ever generated)")
    check_generate_timeout(cfg.rollout.generate_timeout_s)
    if cfg.logging.max_save_failures < 1:
        raise ConfigError(f"logging.max_save_failures={cfg.logging.max_save_failures} must be >= 1 (1 = stop at the "
                          f"first failed checkpoint)")
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
    # the engines' resources, checked before they start
    engine_options(ro.backend, ro.kv_cache_gb, ro.cpu_threads, kv_block_size=ro.kv_block_size)
    check_affinity(cfg.placement.cpu_affinity)
    if truncates_sampling(ro.top_p, ro.top_k, int(hf.get("vocab_size") or 0)) and not cfg.loss.allow_truncated_sampling:
        raise ConfigError(f"rollout.top_p={ro.top_p}, rollout.top_k={ro.top_k} truncate the sampling distribution: "
                          f"logp_behav is then the log-prob under a renormalized truncated distribution that the "
                          f"trainer cannot reproduce from full logits, so r_d is biased; set rollout.top_p=1 and "
                          f"rollout.top_k=-1, or loss.allow_truncated_sampling=true to train anyway")
    check_routing_replay(cfg, hf)
    batch_invariant.check(cfg, hf=hf)


def check_routing_replay(cfg: MegaRLConfig, hf: dict) -> None:
    """rollout.routing_replay needs an MoE model."""
    if not cfg.rollout.routing_replay:
        return
    if not is_moe(hf):
        raise ConfigError(f"rollout.routing_replay=true needs an MoE model; {cfg.model.checkpoint} is dense "
                          f"(its config.json names no experts): set rollout.routing_replay=false")


def refuse_unwired(cfg: MegaRLConfig) -> None:
    """Settings the config accepts (the GPU configs use them) but this training loop does not honour yet."""
    if cfg.advantage.kl_coef > 0 and cfg.placement.trainer_ranks > 1:
        raise ConfigError("advantage.kl_coef > 0 needs a single trainer rank so far; set advantage.kl_coef=0 "
                          "or placement.trainer_ranks=1")


def training_prompts(cfg: MegaRLConfig, tokenizer: RunTokenizer, vocab_size: int) -> PromptDataset | ServiceRows:
    """The rows of data.path, or the rows an agent service posts (agent.rows_from_service)."""
    a = cfg.agent
    if not a.rows_from_service:
        if not cfg.data.path:
            raise ConfigError("data.path is empty: set it to a .jsonl or .parquet file of prompts or hf:NAME[:SPLIT] "
                              "(README, section Data), or let an agent service post the rows with "
                              "agent.rows_from_service=true (rollout.workflow=agent_http, agent.serve=true)")
        return PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed, vocab_size=vocab_size)
    if cfg.rollout.workflow != "agent_http" or not a.serve:
        raise ConfigError(f"agent.rows_from_service=true needs rollout.workflow=agent_http and agent.serve=true "
                          f"(got {cfg.rollout.workflow!r}, serve={a.serve}): the rows come from an agent service")
    if cfg.data.path:
        raise ConfigError(f"agent.rows_from_service=true and data.path={cfg.data.path!r}: the prompts come either "
                          f"from the agent service or from data.path; set data.path= or agent.rows_from_service=false")
    if a.row_wait_s <= 0:
        raise ConfigError(f"agent.row_wait_s={a.row_wait_s} must be > 0")
    return ServiceRows(tokenizer, cfg.data, cfg.rollout.group_size, vocab_size, wait_s=a.row_wait_s)


def load_inputs(cfg: MegaRLConfig, vocab_size: int) -> RunInputs:
    """The run's tokenizer, training prompts and evaluation prompts; bad input fails here, naming the fix."""
    tokenizer = RunTokenizer.load(cfg.model, cfg.rollout, cfg.data, vocab_size=vocab_size)
    dataset = training_prompts(cfg, tokenizer, vocab_size)
    eval_dataset = None
    if cfg.eval.path:
        eval_dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed, vocab_size=vocab_size,
                                                 path=cfg.eval.path, shuffle=False)
    elif cfg.eval.every:
        log.warning("eval.every=%d has no effect: eval.path is empty (no evaluation in this run)", cfg.eval.every)
    if cfg.rollout.workflow in ("agent", "agent_http"):  # the agent, its tools and the template, before anything starts
        check_agent_config(cfg.agent, tokenizer, http=cfg.rollout.workflow == "agent_http")
    if cfg.eval.agent_fn:
        if cfg.rollout.workflow != "agent":
            raise ConfigError(f"eval.agent_fn={cfg.eval.agent_fn!r} needs rollout.workflow=agent (it is "
                              f"{cfg.rollout.workflow!r}); leave eval.agent_fn empty")
        if cfg.eval.path:
            load_agent(cfg.eval.agent_fn, key="eval.agent_fn")
    return RunInputs(tokenizer, dataset, eval_dataset)


def _check_overlong(cfg: MegaRLConfig) -> None:
    buffer = cfg.reward.overlong_buffer
    if buffer == 0:
        return
    if not 0 < buffer <= cfg.rollout.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer={buffer} must be in [0, rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}] (0 = no overlong penalty)")
    if cfg.reward.overlong_penalty < 0:
        raise ConfigError(f"reward.overlong_penalty={cfg.reward.overlong_penalty} must be >= 0 (the reward a "
                          f"response of rollout.max_new_tokens tokens loses)")
    if cfg.rollout.workflow != "single_turn":
        raise ConfigError(f"reward.overlong_buffer applies to single-turn responses, whose limit is "
                          f"rollout.max_new_tokens; rollout.workflow={cfg.rollout.workflow!r} limits each turn, not "
                          f"the episode: set reward.overlong_buffer=0")
