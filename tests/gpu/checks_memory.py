"""The GPU check of megarl's memory plan (tests/gpu/gpu_check.py): the trainer GPU's plan
(megarl/launch/memory.py) against the peak a train step and a checkpoint save measure on a slice of
Qwen3-30B-A3B (with TransformerEngine where it is installed), and the weight sender's share of the runtime
reserve (megarl/launch/runtime_reserve.py) against what a sender process adds on the device while it sends."""
from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from check_helpers import (
    ROOT,
    Skip,
    batch_from,
    derived_yaml,
    local_spec_allowed,
    make_trainer,
    model_checkpoint,
    require,
    require_cuda,
    require_transformer_engine,
)

GB = 1e9
QWEN3_30B = ROOT / "configs" / "models" / "qwen3_30b_a3b.yaml"
#: plan_vs_peak's batch: rows of a 64-token prompt and 448 response tokens, 2048 tokens in one micro-batch
PEAK_ROWS, PEAK_PROMPT, PEAK_ROW = 4, 64, 512
PEAK_ENTROPY_COEF = 0.01
#: the measured peak over the planned one (without its runtime reserve) must lie in [PEAK_LOW, PEAK_HIGH]
PEAK_LOW, PEAK_HIGH = 0.8, 1.1
#: the sender's publish in plan_vs_peak: SENDER_BUCKETS device buckets of rollout.bucket_mb=SENDER_BUCKET_MB
SENDER_BUCKETS, SENDER_BUCKET_MB = 2, 256


def slice_yaml(workdir: Path) -> Path:
    """Qwen3-30B-A3B at full width (hidden 2048, 128 experts, vocab 151936) with 2 layers: ~1.9B parameters."""
    return derived_yaml(QWEN3_30B, workdir / "qwen3_30b_a3b_2layers.yaml", num_hidden_layers=2, max_window_layers=2)


def planned_peak(hf: dict, entropy: bool, local_spec: bool):
    """megarl/launch/memory.py's plan of plan_vs_peak's step: one GPU, bf16, no recompute, one micro-batch of
    PEAK_ROWS rows of PEAK_ROW tokens, no distributed optimizer, no recovery strategy's tensors."""
    from megarl.config import MegaRLConfig
    from megarl.launch.memory import trainer_memory

    cfg = MegaRLConfig()
    cfg.model.dtype, cfg.model.allow_local_spec = "bfloat16", local_spec
    cfg.trainer.micro_batch_tokens, cfg.trainer.recompute = PEAK_ROWS * PEAK_ROW, "none"
    cfg.data.max_prompt_len, cfg.rollout.max_new_tokens = PEAK_PROMPT, PEAK_ROW - PEAK_PROMPT
    cfg.loss.entropy_coef = PEAK_ENTROPY_COEF if entropy else 0.0
    cfg.parallel.use_distributed_optimizer = False
    cfg.recovery.name = "behav"
    layout = SimpleNamespace(tp=1, pp=1, ep=1, dp=1, expert_dp=1, sequence_parallel=False)
    return trainer_memory(cfg, hf, layout)


def entropy_loss(seen: dict):
    """NLL minus PEAK_ENTROPY_COEF x the mean entropy; asks the trainer for the entropy (wants_entropy) and
    records in ``seen`` whether it came."""
    def loss_fn(logp, mb, normalizer, entropy=None):
        mask = mb.loss_mask.to(logp.device)[:, : logp.shape[1]]
        loss = -(logp * mask).sum() / normalizer["n_valid_tokens"]
        seen["entropy"] = entropy is not None
        if entropy is not None:
            bonus = (entropy * mask[:, : entropy.shape[1]]).sum() / normalizer["n_valid_tokens"]
            loss = loss - PEAK_ENTROPY_COEF * bonus
        return loss, {"nll": float(loss.detach())}

    loss_fn.wants_entropy = True
    return loss_fn


def peak_batch(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = PEAK_ROW - PEAK_PROMPT
    reqs = [SimpleNamespace(request_id=f"p{i}", prompt_ids=torch.randint(vocab, (PEAK_PROMPT,), generator=g).tolist())
            for i in range(PEAK_ROWS)]
    outs = [SimpleNamespace(output_ids=torch.randint(vocab, (n,), generator=g).tolist(), logp_behav=[0.0] * n)
            for _ in reqs]
    return batch_from(reqs, outs)


def check_plan_vs_peak(workdir: Path) -> str:
    require_cuda()
    if os.environ.get("GPU_CHECK_REQUIRE_TE") == "1":  # else the local spec where TE is missing
        require_transformer_engine()
    import torch

    if not torch.cuda.is_available():
        raise Skip("measures torch.cuda.max_memory_allocated(): needs a CUDA device")
    t0 = time.perf_counter()
    ckpt = model_checkpoint(slice_yaml(workdir), workdir / "qwen3_30b_a3b_2layers", seed=0)
    print(f"plan_vs_peak: 2-layer Qwen3-30B-A3B checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
    hf = json.loads((ckpt / "config.json").read_text())
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    trainer = make_trainer(ckpt, lr=1e-5, dtype="bfloat16", micro_batch_tokens=PEAK_ROWS * PEAK_ROW, recompute="none")
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated() - base
    batch = peak_batch(int(hf["vocab_size"]))
    seen: dict = {}
    peaks, states = [], []
    for step in (1, 2):  # from step 2 on, Adam's moments exist through the whole step
        torch.cuda.reset_peak_memory_stats()
        m = trainer.train_step(batch, entropy_loss(seen))
        torch.cuda.synchronize()
        require(m.get("skipped", 0.0) == 0.0, f"step {step} was skipped: {trainer.last_skip_reason}")
        peaks.append(torch.cuda.max_memory_allocated() - base)
        states.append(torch.cuda.memory_allocated() - base)
    torch.cuda.reset_peak_memory_stats()
    trainer.save_state(str(workdir / "plan_vs_peak_save"))  # a checkpoint save in the measured peak
    torch.cuda.synchronize()
    save_peak = torch.cuda.max_memory_allocated() - base
    shutil.rmtree(workdir / "plan_vs_peak_save", ignore_errors=True)  # ~27 GB of optimizer state on the disk
    sender_used, sender_planned = sender_on_device()
    measured = max(*peaks, save_peak)
    plan = planned_peak(hf, bool(seen.get("entropy")), local_spec_allowed())
    p = plan.parts
    predicted = plan.peak - p["runtime"]
    ratio = measured / predicted
    detail = (f"peak {measured / GB:.2f} GB (step 1 {peaks[0] / GB:.2f}, step 2 {peaks[1] / GB:.2f}, checkpoint "
              f"save {save_peak / GB:.2f}; the weight sender adds {sender_used / GB:.2f} GB on the device, plan "
              f"{sender_planned / GB:.2f}) vs plan "
              f"{predicted / GB:.2f} GB without its {p['runtime'] / GB:.1f} GB runtime reserve: x{ratio:.2f} "
              f"(limits x{PEAK_LOW}-x{PEAK_HIGH}); weights+gradients built {built / GB:.2f} GB vs plan "
              f"{(p['weights'] + p['gradients']) / GB:.2f}; optimizer after step 1 {(states[0] - built) / GB:.2f} vs "
              f"plan {p['optimizer'] / GB:.2f}; above the model state at the peak {(measured - states[-1]) / GB:.2f} "
              f"vs plan activations {p['activations'] / GB:.2f} + logits {p['logits'] / GB:.2f}; entropy bonus "
              f"{'on' if seen.get('entropy') else 'off (the trainer passed no entropy)'}, "
              f"{'local' if local_spec_allowed() else 'TransformerEngine'} spec, {PEAK_ROWS} rows x {PEAK_ROW} tokens, "
              f"{time.perf_counter() - t0:.0f} s")
    require(measured <= PEAK_HIGH * predicted, f"the plan underestimates the peak: {detail}")
    require(measured >= PEAK_LOW * predicted, f"the plan overestimates the peak: {detail}")
    require(sender_used <= sender_planned, f"the weight sender takes more than the plan's reserve for it: {detail}")
    return detail


def sender_on_device() -> tuple[float, float]:
    """(device bytes a weight sender process adds while it sends SENDER_BUCKETS device buckets, the plan's
    runtime-reserve part for it on one GPU with one engine worker). The device's used memory is sampled
    every 5 ms from before the sender starts until it is closed."""
    import threading

    import torch
    from checks_sender import StallingGroupStandIn, group_info

    from megarl.config import MegaRLConfig
    from megarl.launch.runtime_reserve import runtime_parts
    from megarl.rollout.broadcast_sender import SenderProcess

    cfg = MegaRLConfig()
    cfg.rollout.weight_sync, cfg.rollout.bucket_mb = "broadcast", SENDER_BUCKET_MB
    layout = SimpleNamespace(world_size=1, tp=1, pp=1, ep=1, dp=1, expert_dp=1)
    planned = runtime_parts(cfg, SimpleNamespace(trainer=layout, engines=[SimpleNamespace(tp=1)]))["weight sender"]
    device = torch.device("cuda", torch.cuda.current_device())
    buckets = [(bytes(16), torch.ones(SENDER_BUCKET_MB << 20, dtype=torch.uint8, device=device), 0)
               for _ in range(SENDER_BUCKETS)]  # STALL_AT is past them: the stand-in group never stalls
    torch.cuda.synchronize()
    used0 = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    peak, done = [used0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], total - free)
            time.sleep(0.005)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    proc = SenderProcess(StallingGroupStandIn, device.index)
    try:
        proc.send(group_info(), buckets, timeout_s=120).result(180)
    finally:
        proc.close()
        done.set()
        watcher.join()
    return peak[0] - used0, planned
