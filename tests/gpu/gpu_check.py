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
- plan_vs_peak     megarl's trainer memory plan vs the peak of bf16 train steps (entropy bonus on) and a
                   checkpoint save on Qwen3-30B-A3B at full width with 2 layers (TransformerEngine where it is
                   installed; GPU_CHECK_REQUIRE_TE=1 requires it): measured within 0.8x-1.1x of the plan; and a
                   weight sender's device bytes while it sends within the plan's reserve for it
- publish_memory   three broadcast publishes of the real trainer (host buckets, and on CUDA device buckets
                   handed to the sender by CUDA IPC; gloo to stand-in engines): GPU memory back within 1 MiB,
                   shared memory back too
- cuda_ipc         CUDA-IPC buckets of the project's packing to a spawned process: per-tensor digests match
                   (a corrupted byte is seen), memory back to baseline after torch.cuda.ipc_collect()
- te_grouped_gemm  with TransformerEngine: the tiny MoE's experts run as a grouped GEMM and match HF
- pinned_bytes     snapshot's two kept host copies of a 22.7M-parameter model: one flat buffer each, page-locked,
                   none of it through torch's caching host allocator, within 1% of the host plan's pinned bytes
                   (CPU: the bytes only)
- nccl_init_deadline  a receiver whose trainer side never sets the NCCL communicator up (NCCL does it inside the
                   first collective call): the receive leaves at its step deadline, the update lock free (one
                   GPU is enough: only the receiver touches NCCL; CPU: the same over gloo, the deadline only)
- sender_kill      a weight sender killed mid-publish (its group stalls at bucket 2 of 8, past the deadline): the
                   trainer's GPU memory and the device's free memory back at their baseline; the former flow
                   (a trainer bucket held by a killed process) reported as the negative control (CPU: the
                   same with shared-memory buckets, the node's Shmem back)
- ewma_device      ewma's fold on the GPU over 3 bf16 steps: a host phi folded in the anchor's swap and a phi
                   kept on the GPU (folded in place, pointed at) agree bit for bit; no copy of theta, and the
                   anchor's peak stays within a quarter shard of a plain forward's

The vLLM checks need the official wheel: without it they SKIP with that reason, unless
GPU_CHECK_REQUIRE_VLLM=1 makes them fail; te_spec and te_grouped_gemm likewise with GPU_CHECK_REQUIRE_TE=1.
The checks live beside this harness: check_helpers.py (what they share), checks_trainer.py, checks_engines.py,
checks_memory.py, checks_publish.py, checks_recovery.py, checks_bounds.py, checks_sender.py;
check_selftest.py is --self-test.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))  # the sibling modules, whether this file runs as a script or is loaded by path

from check_helpers import CheckFailed, Skip  # noqa: E402
from check_selftest import self_test  # noqa: E402
from checks_bounds import check_nccl_init_deadline, check_pinned_bytes  # noqa: E402
from checks_engines import (  # noqa: E402
    check_broadcast_gloo,
    check_broadcast_nccl,
    check_hf_broadcast,
    check_hf_broadcast_nccl,
    check_vllm_parity,
)
from checks_memory import check_plan_vs_peak  # noqa: E402
from checks_publish import check_cuda_ipc, check_publish_memory  # noqa: E402
from checks_recovery import check_ewma_device  # noqa: E402
from checks_sender import check_sender_kill  # noqa: E402
from checks_trainer import (  # noqa: E402
    check_bf16_step,
    check_env,
    check_megatron_parity,
    check_rendezvous,
    check_te_grouped_gemm,
    check_te_spec,
    check_train_loop,
    check_verify_recovery,
)


def _check_pass(workdir: Path) -> str:  # harness self-test
    return "ok"


def _check_fail(workdir: Path) -> str:  # harness self-test
    raise CheckFailed("deliberate failure")


CHECKS = {"env": check_env, "rendezvous": check_rendezvous, "megatron_parity": check_megatron_parity,
          "vllm_parity": check_vllm_parity, "broadcast_gloo": check_broadcast_gloo,
          "broadcast_nccl": check_broadcast_nccl, "hf_broadcast": check_hf_broadcast,
          "hf_broadcast_nccl": check_hf_broadcast_nccl, "te_spec": check_te_spec,
          "bf16_step": check_bf16_step, "train_loop": check_train_loop, "verify_recovery": check_verify_recovery,
          "plan_vs_peak": check_plan_vs_peak, "publish_memory": check_publish_memory, "cuda_ipc": check_cuda_ipc,
          "te_grouped_gemm": check_te_grouped_gemm, "ewma_device": check_ewma_device,
          "pinned_bytes": check_pinned_bytes, "nccl_init_deadline": check_nccl_init_deadline,
          "sender_kill": check_sender_kill}
INTERNAL = {"_pass": _check_pass, "_fail": _check_fail}


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
