"""What the GPU checks share (tests/gpu/gpu_check.py): the outcomes, the tiny checkpoint, fake batches,
the reference log-probs, and how an engine or a trainer is started on the GPU."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
TINY_DENSE = ROOT / "configs" / "models" / "tiny_qwen3.yaml"
TINY_MOE = ROOT / "configs" / "models" / "tiny_qwen3_moe.yaml"
#: model.dtype of the train_loop and verify_recovery checks (GPU_CHECK_DTYPE, default bfloat16)
DTYPE = os.environ.get("GPU_CHECK_DTYPE", "bfloat16")
#: extra overrides of the train_loop check, e.g. GPU_CHECK_LOOP_OVERRIDES="rollout.weight_sync=broadcast"
LOOP_OVERRIDES = os.environ.get("GPU_CHECK_LOOP_OVERRIDES", "").split()
MAX_NEW = 24
MIB = 1 << 20


class Skip(Exception):
    """The check does not apply on this machine (reported as SKIP, not a failure)."""


class CheckFailed(AssertionError):
    pass


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


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


def model_checkpoint(model_yaml: Path, out: Path, seed: int = 1) -> Path:
    """A random fp32 checkpoint of ``model_yaml`` (megarl/models/tiny.py), written once per workdir:
    megarl_init.json is its last file, so a write cut short is written again."""
    from megarl.models.tiny import write_tiny_checkpoint

    if not (out / "megarl_init.json").is_file():
        write_tiny_checkpoint(model_yaml, out, seed=seed)
    return out


def derived_yaml(base: Path, out: Path, **fields) -> Path:
    """``base``'s HF config fields with ``fields`` changed and no tokenizer section, written to ``out``."""
    import yaml

    data = yaml.safe_load(base.read_text())
    data.pop("tokenizer", None)
    data.update(fields)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out




def requests(n: int = 8, seed0: int = 0) -> list:
    from megarl.types import GenerateRequest, SamplingParams

    out = []
    for i in range(n):
        prompt = [1] + [4 + (i * 7 + j * 3) % 12 for j in range(6)]
        out.append(GenerateRequest(f"r{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW,
                                                                    seed=seed0 + i)))
    return out


def fake_results(n: int, token, length: int = MAX_NEW) -> list:
    """``n`` engine results of ``length`` tokens ``token(i, k)`` (row i, position k) and log-probs 0."""
    return [SimpleNamespace(output_ids=[token(i, k) for k in range(length)], logp_behav=[0.0] * length)
            for i in range(n)]


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


def hf_reference(ckpt: Path, batch, device) -> None:
    """``batch.logp_behav`` := HF transformers' fp32 log-probs of ``batch.tokens`` on ``device`` (response tokens)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = hf(batch.tokens.to(device)).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
    batch.logp_behav = ref.cpu() * batch.loss_mask


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


def require_transformer_engine() -> None:
    """SKIP without TransformerEngine, unless GPU_CHECK_REQUIRE_TE=1 makes that a failure."""
    from megarl.platform.megatron import have_transformer_engine

    if not have_transformer_engine():
        why = "transformer_engine is not installed (pip install transformer-engine[pytorch])"
        if os.environ.get("GPU_CHECK_REQUIRE_TE") == "1":
            raise CheckFailed(why)
        raise Skip(why)


def start_engine(ckpt: Path, workdir: Path, name: str, env: dict | None = None, backend: str = "vllm"):
    from megarl.rollout.client import launch_engine_process

    extra = ["--gpu-memory-utilization", "0.3", "--max-num-seqs", "16"] if backend == "vllm" else []
    return launch_engine_process(str(ckpt), backend, extra_args=extra, env=env,
                                 log_path=str(workdir / f"{name}.engine.log"), startup_timeout_s=180)


def local_spec_allowed() -> bool:
    """Without TransformerEngine on the device the trainer refuses CUDA unless the local spec is allowed; the
    check then runs the local spec (what it can check), and check_te_spec says TE is missing."""
    from megarl.platform.megatron import have_transformer_engine

    return not have_transformer_engine()


def spec_overrides() -> list[str]:
    return ["model.allow_local_spec=true"] if local_spec_allowed() else []


def make_trainer(ckpt: Path, **kw):
    from megarl.trainer.megatron_trainer import MegatronTrainer

    kw.setdefault("allow_local_spec", local_spec_allowed())
    kw.setdefault("micro_batch_tokens", 4096)
    return MegatronTrainer(str(ckpt), lr=kw.pop("lr", 1e-2), seed=0, **kw)


def reset_megatron() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
