"""The GPU checks of the trainer (tests/gpu/gpu_check.py): the device, NCCL through the launcher, Megatron
against HF transformers (local spec, TransformerEngine, TE's grouped GEMM), bf16 steps, and the `megarl train`
and `megarl verify-recovery` commands on the GPU."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from check_helpers import (
    DTYPE,
    LOOP_OVERRIDES,
    ROOT,
    TINY_MOE,
    Skip,
    batch_from,
    fake_results,
    hf_reference,
    logp_gap,
    make_trainer,
    model_checkpoint,
    nll_loss,
    requests,
    require,
    require_cuda,
    require_official_vllm,
    require_transformer_engine,
    reset_megatron,
    spec_overrides,
    tiny_checkpoint,
)


def check_env(workdir: Path) -> str:
    require_cuda()
    import torch

    from megarl.platform.megatron import have_transformer_engine

    try:
        require_official_vllm()
        import vllm
        vllm_version = vllm.__version__
    except Skip:
        vllm_version = "not installed"
    import megatron.core

    require(torch.cuda.is_bf16_supported(), f"{torch.cuda.get_device_name(0)} does not support bf16")
    nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"megatron-core {megatron.core.__version__}, vllm {vllm_version}, nccl {nccl}, "
            f"transformer_engine {'yes' if have_transformer_engine() else 'no'}")


def check_megatron_parity(workdir: Path) -> str:
    require_cuda()
    import torch

    out = []
    for name in ("tiny_qwen3", "tiny_qwen3_moe"):
        ckpt = model_checkpoint(ROOT / "configs" / "models" / f"{name}.yaml", workdir / f"parity_{name}", seed=1)
        trainer = make_trainer(ckpt)
        require(next(trainer._module().parameters()).is_cuda == torch.cuda.is_available(),
                "the Megatron model is not on the GPU")
        reqs = requests(4)
        batch = batch_from(reqs, fake_results(len(reqs), lambda i, k: 5 + (i + 2 * k) % 11))
        hf_reference(ckpt, batch, "cuda" if torch.cuda.is_available() else "cpu")
        mean, worst, n = logp_gap(trainer.logprobs(batch), batch)
        require(worst < 1e-3, f"{name}: Megatron vs HF log-probs on the GPU differ: mean {mean:.3e} max {worst:.3e}")
        out.append(f"{name} max {worst:.2e} over {n} tokens")
        del trainer
        reset_megatron()
    return "; ".join(out)


def check_rendezvous(workdir: Path) -> str:
    require_cuda()
    proc = subprocess.run(["bash", str(ROOT / "launch" / "torchrun.sh"), "--bootstrap-check",
                           "--config", "configs/tiny_cpu.yaml"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    lines = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith("RENDEZVOUS_CHECK ")]
    require(proc.returncode == 0 and lines, f"launch/torchrun.sh --bootstrap-check exited {proc.returncode}:\n"
                                            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    require(all(r["ok"] and r["backend"] == "nccl" for r in lines), f"rendezvous reports: {lines}")
    return f"{len(lines)} rank(s), backend nccl, all_reduce {lines[0]['all_reduce']}"


def _megarl(args: list[str], workdir: Path, name: str, timeout: float) -> subprocess.CompletedProcess:
    log = workdir / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    text = log.read_text()
    require(proc.returncode == 0, f"megarl {args[0]} exited {proc.returncode}; log tail:\n{text[-3000:]}")
    return proc


def check_train_loop(workdir: Path) -> str:
    require_cuda()
    run_dir = workdir / "train_loop"
    steps = 12
    t0 = time.perf_counter()
    _megarl(["train", "--config", "configs/verify_cpu.yaml", "rollout.max_concurrency=4", "trainer.batch_size=8",
             "rollout.max_new_tokens=32", f"trainer.total_steps={steps}", "recovery.name=snapshot",
             f"model.dtype={DTYPE}", *LOOP_OVERRIDES, *spec_overrides(), f"logging.output_dir={run_dir}",
             f"model.checkpoint={workdir / 'loop_ckpt'}"], workdir, "train_loop", 200)
    dt = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_seen = [r for r in rows if "staleness_max" in r]
    require(len(steps_seen) == steps, f"expected {steps} step rows in metrics.jsonl, found {len(steps_seen)}")
    worst = max(r["staleness_max"] for r in steps_seen)
    require(worst <= 2, f"staleness {worst} > eta 2")
    reward = [r.get("reward_mean", float("nan")) for r in steps_seen]
    return (f"{DTYPE}, {' '.join(LOOP_OVERRIDES) or 'disk weight sync'}: "
            f"{steps} steps in {dt:.0f} s (engine start included), staleness_max {worst}, "
            f"reward first {reward[0]:.3f} last {reward[-1]:.3f}")


def check_verify_recovery(workdir: Path) -> str:
    require_cuda()
    report = workdir / "verify.json"
    strategies = os.environ.get("GPU_CHECK_VERIFY_STRATEGIES", "snapshot,interrupt_sync,dedicated,behav")
    # fp32: exact means float round-off; bf16: the verifier's reference and the strategy's anchor
    # may come from forwards over differently padded batches, so exact means far below behav's gap
    limit = 1e-4 if DTYPE == "float32" else 2e-2
    _megarl(["verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies", strategies,
             "--steps", "6", "--output", str(report), "--tol", str(limit), f"model.dtype={DTYPE}", *spec_overrides(),
             f"model.checkpoint={workdir / 'verify_ckpt'}"], workdir, "verify_recovery", 280)
    rep = json.loads(report.read_text())["strategies"]
    parts, bad = [DTYPE], []
    behav = rep.get("behav", {}).get("mean_abs_err")
    for name, r in rep.items():
        err = r["max_abs_err"] if r["max_abs_err"] is not None else float("nan")
        o = r["oracle"]
        parts.append(f"{name} max {err:.2e} mean {r['mean_abs_err']:.2e} "
                     f"(spliced {r['n_spliced_sequences']}/{r['n_sequences']}, across an update "
                     f"{r['n_spliced_across_update']}; oracle passed={o['passed']} r_d mean "
                     f"{o['mean_abs_err']:.2e} max {o['max_abs_err']:.2e})")
        if o["passed"] is False:
            bad.append(f"{name}: the reference misses the fp32 engine by {o['max_abs_err']:.3e}")
        if r["claims_exact"] and not err <= limit:
            bad.append(f"{name} {err:.3e}")
        # an exact anchor sits far closer to the reference than behav's (r_d): in bf16 both are bf16-sized, so
        # only their ratio tells an exact strategy from one that returns logp_behav or another version's scores
        if r["claims_exact"] and behav is not None and DTYPE != "float32" and not r["mean_abs_err"] <= behav / 5:
            bad.append(f"{name} mean {r['mean_abs_err']:.3e} is not well below behav's {behav:.3e}")
        if r["claims_exact"] and r["copy"]["is_copy"]:
            bad.append(f"{name}'s anchor is a copy of logp_behav")
    if behav is not None and DTYPE != "float32":
        require(behav > 1e-5, f"behav's gap {behav:.3e} is not bf16-sized: the engines' log-probs equal the "
                              f"trainer's, so this check cannot tell exact strategies from behav")
    require(not bad, f"exactness checks failed on the GPU: {bad}")
    return "; ".join(parts)


def check_te_spec(workdir: Path) -> str:
    require_cuda()
    require_transformer_engine()
    ckpt = tiny_checkpoint(workdir)
    trainer = make_trainer(ckpt)
    te_modules = sorted({type(m).__module__ for m in trainer._module().modules()
                         if type(m).__module__.startswith("transformer_engine")})
    require(bool(te_modules), "TransformerEngine is installed but the model has no TE module (local spec was used)")
    mean, worst, n = _te_vs_hf(trainer, ckpt, lambda i, k: 5 + (i + k) % 10)
    return f"TE modules from {', '.join(te_modules)}; vs HF fp32 mean {mean:.2e} max {worst:.2e} over {n} tokens"


def check_te_grouped_gemm(workdir: Path) -> str:
    """The tiny MoE with TransformerEngine: its experts run as one grouped GEMM per layer (TEGroupedMLP,
    megarl/models/build.py grouped_gemm) and its log-probs match HF transformers fp32 within te_spec's limits."""
    require_cuda()
    require_transformer_engine()
    from megarl.models.build import grouped_gemm

    require(grouped_gemm(), "TransformerEngine imports but megarl.models.build.grouped_gemm() is False "
                            "(CUDA unavailable?): the experts would not be grouped")
    ckpt = model_checkpoint(TINY_MOE, workdir / "parity_tiny_qwen3_moe", seed=1)
    trainer = make_trainer(ckpt)
    require(bool(getattr(trainer.config, "moe_grouped_gemm", False)),
            "the trainer's TransformerConfig has moe_grouped_gemm off")
    grouped = sorted({type(m).__name__ for m in trainer._module().modules() if "Grouped" in type(m).__name__})
    require(bool(grouped), "moe_grouped_gemm is on but the model has no grouped-GEMM module "
                           f"(expert modules: {_expert_modules(trainer)})")
    mean, worst, n = _te_vs_hf(trainer, ckpt, lambda i, k: 5 + (i + 3 * k) % 11)
    return f"grouped-GEMM modules {', '.join(grouped)}; vs HF fp32 mean {mean:.2e} max {worst:.2e} over {n} tokens"


def _expert_modules(trainer) -> list[str]:
    return sorted({type(m).__name__ for name, m in trainer._module().named_modules() if "experts" in name})


def _te_vs_hf(trainer, ckpt: Path, token) -> tuple[float, float, int]:
    """The TE model's log-probs against HF transformers fp32 on the GPU (limits 5e-3 mean, 5e-2 max)."""
    reqs = requests(4)
    batch = batch_from(reqs, fake_results(len(reqs), token))
    hf_reference(ckpt, batch, "cuda")
    mean, worst, n = logp_gap(trainer.logprobs(batch), batch)
    require(mean < 5e-3 and worst < 5e-2,
            f"TE model vs HF log-probs: mean {mean:.3e} max {worst:.3e} (limits 5e-3 / 5e-2)")
    return mean, worst, n


def check_bf16_step(workdir: Path) -> str:
    require_cuda()
    import torch

    from megarl.trainer.megatron_trainer import MegatronTrainer

    params = inspect.signature(MegatronTrainer.__init__).parameters
    key = next((k for k in ("dtype", "params_dtype", "bf16") if k in params), None)
    require(key is not None, "MegatronTrainer takes no dtype/bf16 argument: bf16 training is not wired "
                             "(model.dtype=bfloat16 in the GPU configs does not reach the trainer)")
    ckpt = tiny_checkpoint(workdir)
    value = True if key == "bf16" else ("bfloat16" if key == "dtype" else torch.bfloat16)
    trainer = make_trainer(ckpt, lr=1e-2, **{key: value})
    dtypes = {p.dtype for p in trainer._module().parameters()}
    require(torch.bfloat16 in dtypes, f"{key}={value!r} but the model's parameters are {dtypes}")
    reqs = requests(8)
    batch = batch_from(reqs, fake_results(len(reqs), lambda i, k: 5 + (i * 3 + k) % 10))
    losses = []
    for _ in range(4):
        m = trainer.train_step(batch, nll_loss)
        require(m.get("skipped", 0.0) == 0.0, f"bf16 step skipped: {trainer.last_skip_reason}")
        require(all(v == v and abs(v) != float("inf") for v in (m["loss"], m["grad_norm"])), f"non-finite: {m}")
        losses.append(m["loss"])
    require(losses[-1] < losses[0], f"loss did not go down over 4 bf16 steps: {losses}")
    return (f"params {sorted(str(d) for d in dtypes)}; loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"version {trainer.version}")

