"""The GPU paths of megarl, checked on one GPU with the tiny model (driven by launch/gpu_check.sh).

    python tests/gpu/gpu_check.py CHECK --workdir DIR   run one check; the last line is
                                                     GPU_CHECK PASS|SKIP|FAIL CHECK: detail
    python tests/gpu/gpu_check.py --list
    python tests/gpu/gpu_check.py --self-test           CPU: every API the checks call exists and the
                                                     helpers line tokens up right (no GPU needed)

Checks (each in its own process, so a crashed engine takes down only its own):

- env              CUDA, NCCL, bf16; reports whether the official vllm wheel and TransformerEngine are there
- rendezvous       launch/torchrun.sh --bootstrap-check: NCCL all_reduce through the launcher
- megatron_parity  Megatron-core on CUDA (dense and MoE tiny Qwen3) vs HF transformers on CUDA, fp32
- vllm_parity      vLLM (bf16) generate + per-token logp_behav vs the Megatron trainer's log-probs
- broadcast_gloo   trainer step -> weights over gloo into the GPU vLLM engine -> engine log-probs match
                   the trainer's new ones (the vLLM GPU reload path; runs on one GPU)
- broadcast_nccl   the same over NCCL; needs a second GPU for the engine (NCCL refuses two ranks on
                   one device), else SKIP
- hf_broadcast     the broadcast round trip into the HF engine on the GPU (gloo)
- hf_broadcast_nccl  the same over NCCL (one GPU: NCCL refuses two ranks on a device -> SKIP)
- te_spec          with TransformerEngine: the model is built with TE modules and matches HF
- bf16_step        bf16 Megatron train steps: finite, applied, loss goes down
- train_loop       `megarl train` end to end on the GPU (HF engine, snapshot recovery, eta 2, GPU_CHECK_DTYPE)
- verify_recovery  `megarl verify-recovery` on the GPU: exact strategies vs behav (GPU_CHECK_DTYPE)

The vLLM checks need the official wheel: without it they SKIP with that reason, unless
GPU_CHECK_REQUIRE_VLLM=1 makes them fail; te_spec likewise with GPU_CHECK_REQUIRE_TE=1.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TINY_DENSE = ROOT / "configs" / "models" / "tiny_qwen3.yaml"
#: model.dtype of the train_loop and verify_recovery checks (GPU_CHECK_DTYPE, default bfloat16)
DTYPE = os.environ.get("GPU_CHECK_DTYPE", "bfloat16")
#: extra overrides of the train_loop check, e.g. GPU_CHECK_LOOP_OVERRIDES="rollout.weight_sync=broadcast"
LOOP_OVERRIDES = os.environ.get("GPU_CHECK_LOOP_OVERRIDES", "").split()
MAX_NEW = 24


class Skip(Exception):
    """The check does not apply on this machine (reported as SKIP, not a failure)."""


class CheckFailed(AssertionError):
    pass


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


# -- shared helpers ------------------------------------------------------------------------------
def tiny_checkpoint(workdir: Path, name: str = "tiny", seed: int = 0) -> Path:
    """Tiny dense Qwen3 whose fp32 weights are bf16 values and whose config says bfloat16.

    A bf16 engine then holds exactly the trainer's numbers and only activations
    round differently; updates stay fp32 on the wire like the checkpoint.
    """
    from safetensors.torch import load_file, save_file

    from megarl.models.tiny import write_tiny_checkpoint

    out = Path(workdir) / name
    if (out / "model.safetensors").is_file():
        return out
    write_tiny_checkpoint(TINY_DENSE, out, seed=seed)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v.bfloat16().float().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def requests(n: int = 8, seed0: int = 0) -> list:
    from megarl.types import GenerateRequest, SamplingParams

    out = []
    for i in range(n):
        prompt = [1] + [4 + (i * 7 + j * 3) % 12 for j in range(6)]
        out.append(GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW,
                                                                    seed=seed0 + i)))
    return out


def batch_from(reqs: list, results: list, version: int = 0):
    """TrainBatch of prompt+response rows; logp_behav of response token i at index len(prompt)-1+i."""
    import torch

    from megarl.types import TrainBatch

    seqs = [list(r.prompt_ids) + list(res.output_ids) for r, res in zip(reqs, results)]
    B, L = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(B, L, dtype=torch.long)
    mask, behav = torch.zeros(B, L - 1), torch.zeros(B, L - 1)
    for b, (r, res) in enumerate(zip(reqs, results)):
        tokens[b, :len(seqs[b])] = torch.tensor(seqs[b])
        p = len(r.prompt_ids)
        for i, lp in enumerate(res.logp_behav):
            mask[b, p - 1 + i], behav[b, p - 1 + i] = 1.0, float(lp)
    z = torch.zeros(B, L - 1)
    return TrainBatch(tokens=tokens, seq_lens=torch.tensor([len(s) for s in seqs]), loss_mask=mask,
                      logp_behav=behav, versions=z.long(), advantages=z, traj_ids=[r.request_id for r in reqs],
                      prompt_lens=torch.tensor([len(r.prompt_ids) for r in reqs]), version=version)


def logp_gap(logp, batch) -> tuple[float, float, int]:
    """mean and max |logp - batch.logp_behav| over response tokens, and how many."""
    m = batch.loss_mask.bool()
    d = (logp.float().cpu()[m] - batch.logp_behav[m]).abs()
    return float(d.mean()), float(d.max()), int(m.sum())


def nll_loss(logp, mb, normalizer):
    loss = -(logp * mb.loss_mask.to(logp.device)).sum() / normalizer["n_valid_tokens"]
    return loss, {"nll": float(loss.detach())}


def require_cuda() -> None:
    """GPU_CHECK_ALLOW_CPU=1 lets the checks run on a CPU machine (to test the checks themselves)."""
    import torch

    if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1":
        return
    require(torch.cuda.is_available(), "torch.cuda.is_available() is False: no GPU or a CPU build of torch")


def require_official_vllm() -> None:
    from importlib import metadata

    try:
        metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        names = [d.metadata["Name"] for d in metadata.distributions() if "vllm" in (d.metadata["Name"] or "")]
        why = f"the official `vllm` wheel is not installed (found: {names or 'nothing'}); pip install vllm"
        if os.environ.get("GPU_CHECK_REQUIRE_VLLM") == "1":
            raise CheckFailed(why) from None
        raise Skip(why) from None
    from vllm.platforms import current_platform

    require(current_platform.is_cuda(), f"vllm platform is {type(current_platform).__name__}, not CUDA")


def start_engine(ckpt: Path, workdir: Path, name: str, env: dict | None = None, backend: str = "vllm"):
    from megarl.rollout.client import launch_engine_process

    extra = ["--gpu-memory-utilization", "0.3", "--max-num-seqs", "16"] if backend == "vllm" else []
    return launch_engine_process(str(ckpt), backend, extra_args=extra, env=env,
                                 log_path=str(workdir / f"{name}.engine.log"), startup_timeout_s=180)


def local_spec_allowed() -> bool:
    """Without TransformerEngine on the device the trainer refuses CUDA unless the local spec is allowed; the
    check then runs the local spec (what it can check), and check_te_spec says TE is missing."""
    from megarl.platform import have_transformer_engine

    return not have_transformer_engine()


def spec_overrides() -> list[str]:
    return ["model.allow_local_spec=true"] if local_spec_allowed() else []


def make_trainer(ckpt: Path, **kw):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    kw.setdefault("allow_local_spec", local_spec_allowed())
    return MegatronTrainer(str(ckpt), lr=kw.pop("lr", 1e-2), micro_batch_tokens=4096, seed=0, **kw)


# -- the checks -------------------------------------------------------------------------------------
def check_env(workdir: Path) -> str:
    require_cuda()
    import torch

    from megarl.platform import have_transformer_engine

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
    import transformers

    from megarl.models.tiny import write_tiny_checkpoint

    out = []
    for name in ("tiny_qwen3", "tiny_qwen3_moe"):
        ckpt = workdir / f"parity_{name}"
        if not (ckpt / "config.json").is_file():
            write_tiny_checkpoint(ROOT / "configs" / "models" / f"{name}.yaml", ckpt, seed=1)
        trainer = make_trainer(ckpt)
        require(next(trainer._module().parameters()).is_cuda == torch.cuda.is_available(),
                "the Megatron model is not on the GPU")
        reqs = requests(4)
        fake = [type("R", (), {"output_ids": [5 + (i + 2 * k) % 11 for k in range(MAX_NEW)],
                               "logp_behav": [0.0] * MAX_NEW})() for i in range(len(reqs))]
        batch = batch_from(reqs, fake)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).to(dev).eval()
        with torch.no_grad():
            logits = hf(batch.tokens.to(dev)).logits.float()
        ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:].to(dev).unsqueeze(-1)).squeeze(-1)
        batch.logp_behav = ref.cpu() * batch.loss_mask
        mean, worst, n = logp_gap(trainer.logprobs(batch), batch)
        require(worst < 1e-3, f"{name}: Megatron vs HF log-probs on the GPU differ: mean {mean:.3e} max {worst:.3e}")
        out.append(f"{name} max {worst:.2e} over {n} tokens")
        del trainer, hf
        _reset_megatron()
    return "; ".join(out)


def _reset_megatron() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


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


def check_vllm_parity(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    from megarl.rollout.client import stop_engine_process

    ckpt = tiny_checkpoint(workdir)
    proc, client = start_engine(ckpt, workdir, "parity")
    try:
        reqs = requests()

        async def go():
            try:
                return await asyncio.gather(*(client.generate(r) for r in reqs))
            finally:
                await client.close()
        results = asyncio.run(go())
    finally:
        stop_engine_process(proc)
    require(all(len(r.output_ids) == MAX_NEW for r in results),
            f"expected {MAX_NEW} tokens per request, got {[len(r.output_ids) for r in results]}")
    batch = batch_from(reqs, results)
    mean, worst, n = logp_gap(make_trainer(ckpt).logprobs(batch), batch)
    require(mean < 0.02 and worst < 0.2, f"trainer (fp32) vs vLLM (bf16) log-probs differ: mean {mean:.3e} "
                                         f"max {worst:.3e} over {n} tokens (limits 0.02 / 0.2)")
    return f"{n} tokens, |trainer fp32 - vLLM bf16| mean {mean:.2e} max {worst:.2e}"


def _broadcast_round_trip(workdir: Path, backend: str, engine_env: dict | None, engine: str = "vllm") -> str:
    from megarl.rollout.client import free_port, stop_engine_process
    from megarl.rollout.router import EngineRouter
    from megarl.rollout.weight_spec import tensor_specs
    from megarl.rollout.weight_sync import WeightBroadcaster

    ckpt = tiny_checkpoint(workdir)
    trainer = make_trainer(ckpt, lr=5e-2)
    proc, client = start_engine(ckpt, workdir, f"broadcast_{engine}_{backend}", env=engine_env, backend=engine)
    reqs = requests(seed0=100)
    try:
        async def before():
            return await asyncio.gather(*(client.generate(r) for r in reqs))
        batch = batch_from(reqs, asyncio.run(before()))
        parity_mean, _, _ = logp_gap(trainer.logprobs(batch), batch)  # engine vs trainer, same weights
        metrics = trainer.train_step(batch, nll_loss)
        require(metrics.get("skipped", 0.0) == 0.0, f"train step skipped: {trainer.last_skip_reason}")
        named = list(trainer.export_hf_weights())
        sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, backend=backend, timeout_s=120)
        box: dict = {}

        def send():
            try:
                box["stats"] = sender.broadcast(iter(named), bucket_bytes=1 << 16)
            except BaseException as e:  # reported below, the engine side fails too
                box["error"] = e

        async def update_and_score():
            th = threading.Thread(target=send, daemon=True)
            th.start()
            try:
                await EngineRouter([client]).update_weights_from_broadcast(sender.group_info(), tensor_specs(named), 1)
            finally:
                await asyncio.to_thread(th.join, 120)
            try:
                return await asyncio.gather(*(client.generate(r) for r in reqs))
            finally:
                await client.close()
        t0 = time.perf_counter()
        after = asyncio.run(update_and_score())
        dt = time.perf_counter() - t0
        sender.close()
        require("error" not in box, f"trainer-side broadcast failed: {box.get('error')!r}")
    finally:
        stop_engine_process(proc)
    require(all(v == 1 for r in after for v in r.versions), "tokens after the update are not tagged version 1")
    new_batch = batch_from(reqs, after, version=1)
    mean, worst, n = logp_gap(trainer.logprobs(new_batch), new_batch)
    stale_mean, _, _ = logp_gap(trainer.logprobs(batch), batch)  # the new weights against the old engine's tokens
    # the weights arrived intact: the engine matches the new weights as closely as it matched the old ones
    # (the engines' own precision, fp32 ~1e-6 or bf16 ~1e-2), and far more closely than the old weights do
    # (an update that did not land, or landed half, would leave the gap at the stale level)
    require(mean <= max(3 * parity_mean, 1e-5),
            f"after the {backend} update the engine misses the trainer's new weights by mean {mean:.3e} (max "
            f"{worst:.3e}), more than 3x the {parity_mean:.3e} it missed the same weights by before the step")
    require(stale_mean >= 5 * mean, f"the step moved the policy too little to tell an update that landed from one "
                                    f"that did not: stale gap {stale_mean:.3e} vs {mean:.3e} after the update")
    return (f"{box['stats']['tensors']} tensors, {box['stats']['bytes'] / 1e6:.1f} MB, update+generate {dt:.1f} s; "
            f"engine vs trainer after update mean {mean:.2e} max {worst:.2e} (same weights before the step "
            f"{parity_mean:.2e}; new weights vs the old engine {stale_mean:.2e})")


def check_broadcast_gloo(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    return _broadcast_round_trip(workdir, "gloo", None)


def check_broadcast_nccl(workdir: Path) -> str:
    require_cuda()
    require_official_vllm()
    import torch

    if torch.cuda.device_count() < 2 and os.environ.get("GPU_CHECK_FORCE_NCCL") != "1":
        raise Skip("one GPU: NCCL refuses two ranks (trainer, engine) on the same device; "
                   "broadcast_gloo covered the engine side; set GPU_CHECK_FORCE_NCCL=1 to try anyway")
    env = {"CUDA_VISIBLE_DEVICES": "1"} if torch.cuda.device_count() >= 2 else None
    return _broadcast_round_trip(workdir, "nccl", env)


def check_hf_broadcast(workdir: Path) -> str:
    require_cuda()
    return _broadcast_round_trip(workdir, "gloo", None, engine="hf")


def check_hf_broadcast_nccl(workdir: Path) -> str:
    """The NCCL broadcast into the HF engine; with one GPU trainer and engine share the device,
    which NCCL refuses ("Duplicate GPU detected") -- reported as SKIP with NCCL's own words."""
    require_cuda()
    import torch

    env = {"CUDA_VISIBLE_DEVICES": "1"} if torch.cuda.device_count() >= 2 else None
    try:
        return _broadcast_round_trip(workdir, "nccl", env, engine="hf")
    except Exception as e:
        logs = " ".join(p.read_text(errors="replace") for p in workdir.glob("broadcast_hf_nccl*.log"))
        if torch.cuda.device_count() < 2 and "Duplicate GPU" in f"{e} {logs}":
            raise Skip("one GPU: NCCL refused trainer and engine on the same device (Duplicate GPU detected); "
                       "the gloo broadcast covers the engine side") from None
        raise


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
    from megarl.platform import have_transformer_engine

    if not have_transformer_engine():
        why = "transformer_engine is not installed (pip install transformer-engine[pytorch])"
        if os.environ.get("GPU_CHECK_REQUIRE_TE") == "1":
            raise CheckFailed(why)
        raise Skip(why)
    import torch
    import transformers

    ckpt = tiny_checkpoint(workdir)
    trainer = make_trainer(ckpt)
    te_modules = sorted({type(m).__module__ for m in trainer._module().modules()
                         if type(m).__module__.startswith("transformer_engine")})
    require(bool(te_modules), "TransformerEngine is installed but the model has no TE module (local spec was used)")
    reqs = requests(4)
    fake = [type("R", (), {"output_ids": [5 + (i + k) % 10 for k in range(MAX_NEW)], "logp_behav": [0.0] * MAX_NEW})()
            for i in range(len(reqs))]
    batch = batch_from(reqs, fake)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(batch.tokens.cuda()).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:].cuda().unsqueeze(-1)).squeeze(-1)
    batch.logp_behav = ref.cpu() * batch.loss_mask
    mean, worst, n = logp_gap(trainer.logprobs(batch), batch)
    require(mean < 5e-3 and worst < 5e-2,
            f"TE model vs HF log-probs: mean {mean:.3e} max {worst:.3e} (limits 5e-3 / 5e-2)")
    return f"TE modules from {', '.join(te_modules)}; vs HF fp32 mean {mean:.2e} max {worst:.2e} over {n} tokens"


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
    fake = [type("R", (), {"output_ids": [5 + (i * 3 + k) % 10 for k in range(MAX_NEW)],
                           "logp_behav": [0.0] * MAX_NEW})() for i in range(len(reqs))]
    batch = batch_from(reqs, fake)
    losses = []
    for _ in range(4):
        m = trainer.train_step(batch, nll_loss)
        require(m.get("skipped", 0.0) == 0.0, f"bf16 step skipped: {trainer.last_skip_reason}")
        require(all(v == v and abs(v) != float("inf") for v in (m["loss"], m["grad_norm"])), f"non-finite: {m}")
        losses.append(m["loss"])
    require(losses[-1] < losses[0], f"loss did not go down over 4 bf16 steps: {losses}")
    return (f"params {sorted(str(d) for d in dtypes)}; loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"version {trainer.version}")


def _check_pass(workdir: Path) -> str:  # harness self-test
    return "ok"


def _check_fail(workdir: Path) -> str:  # harness self-test
    raise CheckFailed("deliberate failure")


CHECKS = {"env": check_env, "rendezvous": check_rendezvous, "megatron_parity": check_megatron_parity,
          "vllm_parity": check_vllm_parity, "broadcast_gloo": check_broadcast_gloo,
          "broadcast_nccl": check_broadcast_nccl, "hf_broadcast": check_hf_broadcast,
          "hf_broadcast_nccl": check_hf_broadcast_nccl, "te_spec": check_te_spec,
          "bf16_step": check_bf16_step, "train_loop": check_train_loop, "verify_recovery": check_verify_recovery}
INTERNAL = {"_pass": _check_pass, "_fail": _check_fail}


# -- CPU self-test ------------------------------------------------------------------------------------
def _has_params(fn, *names: str) -> list[str]:
    params = inspect.signature(fn).parameters
    return [n for n in names if n not in params]


def self_test(workdir: Path) -> list[str]:
    """What the checks rely on, verified without a GPU; returns the problems found."""
    problems: list[str] = []

    def need(what: str, ok: bool) -> None:
        if not ok:
            problems.append(what)

    from megarl.rollout import client, weight_spec, weight_sync
    from megarl.rollout.router import EngineRouter
    from megarl.trainer.megatron_trainer import MegatronTrainer

    missing = _has_params(client.launch_engine_process, "checkpoint", "extra_args", "env", "log_path",
                          "startup_timeout_s")
    need(f"launch_engine_process lacks {missing}", not missing)
    need("stop_engine_process missing", callable(getattr(client, "stop_engine_process", None)))
    for m in ("generate", "update_weights_from_broadcast", "close"):
        need(f"EngineClient.{m} missing", callable(getattr(client.EngineClient, m, None)))
    need("EngineRouter.update_weights_from_broadcast missing",
         callable(getattr(EngineRouter, "update_weights_from_broadcast", None)))
    missing = _has_params(weight_sync.WeightBroadcaster.__init__, "host", "port", "world_size", "backend", "timeout_s")
    need(f"WeightBroadcaster lacks {missing}", not missing)
    for m in ("group_info", "broadcast", "close"):
        need(f"WeightBroadcaster.{m} missing", callable(getattr(weight_sync.WeightBroadcaster, m, None)))
    need("weight_spec.tensor_specs missing", callable(getattr(weight_spec, "tensor_specs", None)))
    missing = _has_params(MegatronTrainer.__init__, "checkpoint_dir", "lr", "micro_batch_tokens", "seed")
    need(f"MegatronTrainer lacks {missing}", not missing)
    for m in ("logprobs", "train_step", "export_hf_weights", "_module"):
        need(f"MegatronTrainer.{m} missing", callable(getattr(MegatronTrainer, m, None)))
    from megarl.cli import build_parser

    engine_help = build_parser(only="engine")._subparsers._group_actions[0].choices["engine"].format_help()
    for flag in ("--gpu-memory-utilization", "--max-num-seqs"):
        need(f"`megarl engine` has no {flag}", flag in engine_help)
    # helpers: token alignment and the bf16-valued checkpoint
    reqs = requests(2)
    fake = [type("R", (), {"output_ids": [5, 6, 7], "logp_behav": [-0.5, -1.0, -1.5]})() for _ in reqs]
    batch = batch_from(reqs, fake)
    p = len(reqs[0].prompt_ids)
    need("batch_from misplaces logp_behav", batch.logp_behav[0, p - 1:p + 2].tolist() == [-0.5, -1.0, -1.5]
         and int(batch.loss_mask.sum()) == 6 and batch.tokens[0, p].item() == 5)
    ckpt = tiny_checkpoint(workdir)
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    need("tiny checkpoint weights are not bf16 values",
         all(bool((t == t.bfloat16().float()).all()) for t in tensors.values()))
    need("tiny checkpoint config is not bfloat16",
         json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "bfloat16")
    return problems


def run_one(name: str, workdir: Path) -> int:
    fn = CHECKS.get(name) or INTERNAL.get(name)
    if fn is None:
        print(f"GPU_CHECK FAIL {name}: unknown check; valid: {', '.join(CHECKS)}", flush=True)
        return 2
    try:
        detail = fn(workdir)
    except Skip as e:
        print(f"GPU_CHECK SKIP {name}: {e}", flush=True)
        return 0
    except BaseException as e:  # any failure, loudly, with its traceback
        traceback.print_exc()
        print(f"GPU_CHECK FAIL {name}: {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
        return 1
    print(f"GPU_CHECK PASS {name}: {detail}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", nargs="?", help="the check to run")
    ap.add_argument("--workdir", default=None, help="scratch directory (tiny checkpoint, engine logs)")
    ap.add_argument("--list", action="store_true", help="print the checks in order")
    ap.add_argument("--self-test", action="store_true", help="CPU-only: the APIs and helpers the checks use")
    args = ap.parse_args(argv)
    if args.list:
        print(" ".join(CHECKS))
        return 0
    workdir = Path(args.workdir or os.environ.get("GPU_CHECK_WORKDIR") or "/tmp/megarl-gpu-check")
    workdir.mkdir(parents=True, exist_ok=True)
    if args.self_test:
        problems = self_test(workdir)
        for p in problems:
            print(f"GPU_CHECK FAIL self-test: {p}", flush=True)
        if not problems:
            print("GPU_CHECK PASS self-test: checks' APIs present, helpers aligned", flush=True)
        return 1 if problems else 0
    if not args.check:
        ap.error("name a check (see --list) or use --self-test")
    return run_one(args.check, workdir)


if __name__ == "__main__":
    sys.exit(main())
