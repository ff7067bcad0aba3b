"""The GPU check of a recovery strategy's device path (tests/gpu/gpu_check.py): ewma's fold on the trainer's GPU."""
from __future__ import annotations

from pathlib import Path

from check_helpers import (
    batch_from,
    fake_results,
    make_trainer,
    nll_loss,
    requests,
    require,
    require_cuda,
    tiny_checkpoint,
)

#: elements the check's folds take at once: small, so their fp32 temporaries stay far below one shard and the
#: memory bound below sees a second copy of the parameters if one is taken
CHECK_FOLD_CHUNK = 1 << 12


def check_ewma_device(workdir: Path) -> str:
    """ewma on the bf16 Megatron trainer, two ways side by side over 3 real steps: a host phi folded on the GPU
    while the anchor swaps it in, and a phi kept on the GPU, folded there in place and pointed at by the forward.
    Both fold on the GPU with the same draws, so phi and the anchor agree bit for bit; the GPU phi's anchor takes
    no copy of theta, its forward reads phi's own storage, and on CUDA its peak stays within a quarter shard of a
    plain forward's (a saved copy of the parameters would add a whole one)."""
    require_cuda()
    import torch

    import recovery.ewma as ewma_mod
    from recovery.base import RecoveryContext
    from recovery.ewma import Ewma, EwmaConfig

    ewma_mod.FOLD_CHUNK = CHECK_FOLD_CHUNK
    trainer = make_trainer(tiny_checkpoint(workdir), lr=1e-2, dtype="bfloat16")
    reqs = requests(8)
    batch = batch_from(reqs, fake_results(len(reqs), lambda i, k: 5 + (i * 3 + k) % 10))
    ctx = RecoveryContext(trainer=trainer, eta=2)
    host = Ewma(EwmaConfig(beta=0.5, tau=0.0), ctx)
    on_gpu = Ewma(EwmaConfig(beta=0.5, tau=0.0, phi_on_gpu=True), ctx)
    for s in (host, on_gpu):
        s.anchor(batch, [])  # phi = theta_0
    module = trainer._module()
    shard = sum(p.numel() * p.element_size() for p in module.parameters())
    cuda = next(module.parameters()).is_cuda
    copies, seen = [], []
    get_params, logprobs = trainer.get_params, trainer.logprobs
    trainer.get_params = lambda device="cpu": copies.append(device) or get_params(device)
    trainer.logprobs = lambda b: seen.append(next(module.parameters()).data_ptr()) or logprobs(b)
    extra = []
    for _ in range(3):
        trainer.train_step(batch, nll_loss)
        for s in (host, on_gpu):
            s.after_optimizer_step(trainer.version, {})
        want = host.anchor(batch, [])
        forward_peak = _peak(lambda: logprobs(batch), cuda)
        copies.clear(), seen.clear()
        got, anchor_peak = _timed_anchor(on_gpu, batch, cuda)
        extra.append(anchor_peak - forward_peak)
        require(not copies, f"the anchor with phi on the GPU took copies of theta: {copies}")
        first = next(iter(on_gpu._phi.values()))
        require(seen == [first.data_ptr()], "the anchor's forward did not read phi's own storage")
        require(first.device == next(module.parameters()).device and
                next(iter(host._phi.values())).device.type == "cpu", "phi is not where each strategy keeps it")
        differ = [k for k in host._phi if not torch.equal(host._phi[k].to(first.device), on_gpu._phi[k])]
        require(not differ, f"phi folded in place differs from the host phi folded in the swap: {differ[:3]}")
        require(torch.equal(got.logp_anchor, want.logp_anchor), "the two anchors differ")
        if cuda:
            require(anchor_peak - forward_peak < shard / 4,
                    f"the anchor's peak is {(anchor_peak - forward_peak) / 2**20:.2f} MiB over a plain forward's, "
                    f"a shard is {shard / 2**20:.2f} MiB: a copy of the parameters was taken")
    require(next(module.parameters()).data_ptr() != seen[0], "the parameters still point at phi")
    mem = (f"; anchor peak over a plain forward {max(extra) / 2**20:.3f} MiB (shard {shard / 2**20:.2f} MiB)"
           if cuda else "; memory not measured off CUDA")
    return f"3 folds, phi and anchors equal bit for bit, no copy of theta{mem}"


def _peak(fn, cuda: bool) -> int:
    """Peak allocated bytes while ``fn`` runs, over what was allocated before (0 off CUDA)."""
    import torch

    if not cuda:
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _timed_anchor(strategy, batch, cuda: bool):
    out = []
    peak = _peak(lambda: out.append(strategy.anchor(batch, [])), cuda)
    return out[0], peak
