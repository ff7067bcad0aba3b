"""``gpu_check.py --self-test``: what the GPU checks rely on, verified on a CPU machine (no GPU needed): the APIs
they call take the arguments they pass, and their helpers, plan, batches and packing line up."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from check_helpers import MIB, TINY_DENSE, batch_from, derived_yaml, local_spec_allowed, requests, tiny_checkpoint

Need = Callable[[str, bool], None]


def _has_params(fn, *names: str) -> list[str]:
    params = inspect.signature(fn).parameters
    return [n for n in names if n not in params]


def self_test(workdir: Path) -> list[str]:
    """Every section below, run; returns the problems found."""
    problems: list[str] = []

    def need(what: str, ok: bool) -> None:
        if not ok:
            problems.append(what)

    for section in (_engine_apis, _trainer_apis, _helpers, _plan_vs_peak, _publish_memory, _cuda_ipc,
                    _te_grouped_gemm, _ewma_device, _bounds, _sender_kill):
        section(need, workdir)
    return problems


def _engine_apis(need: Need, workdir: Path) -> None:
    from megarl.rollout import client, weight_spec, weight_sync
    from megarl.rollout.router import EngineRouter

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
    from megarl.cli import build_parser

    engine_help = build_parser(only="engine")._subparsers._group_actions[0].choices["engine"].format_help()
    for flag in ("--gpu-memory-utilization", "--max-num-seqs"):
        need(f"`megarl engine` has no {flag}", flag in engine_help)


def _trainer_apis(need: Need, workdir: Path) -> None:
    from megarl.trainer.megatron_trainer import MegatronTrainer

    missing = _has_params(MegatronTrainer.__init__, "checkpoint_dir", "lr", "micro_batch_tokens", "seed", "dtype",
                          "recompute", "allow_local_spec")
    need(f"MegatronTrainer lacks {missing}", not missing)
    for m in ("logprobs", "train_step", "export_hf_weights", "exported_hf_config", "_module"):
        need(f"MegatronTrainer.{m} missing", callable(getattr(MegatronTrainer, m, None)))
    need("MegatronTrainer.export_hf_weights takes no to_host", not _has_params(MegatronTrainer.export_hf_weights,
                                                                                "to_host"))
    need("MegatronTrainer.train_step does not read a loss function's wants_entropy (plan_vs_peak's entropy bonus)",
         "wants_entropy" in inspect.getsource(MegatronTrainer.train_step))


def _helpers(need: Need, workdir: Path) -> None:
    """Token alignment and the bf16-valued checkpoint."""
    reqs = requests(2)
    fake = [SimpleNamespace(output_ids=[5, 6, 7], logp_behav=[-0.5, -1.0, -1.5]) for _ in reqs]
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


def _plan_vs_peak(need: Need, workdir: Path) -> None:
    """The 2-layer slice's YAML is one write_tiny_checkpoint takes, and the plan of its step adds up."""
    import torch
    from checks_memory import GB, PEAK_PROMPT, PEAK_ROW, PEAK_ROWS, entropy_loss, peak_batch, planned_peak, slice_yaml

    from megarl.launch import memory
    from megarl.models.tiny import load_model_yaml

    need(f"trainer_memory lacks {_has_params(memory.trainer_memory, 'cfg', 'hf', 't')}",
         not _has_params(memory.trainer_memory, "cfg", "hf", "t"))
    fields = load_model_yaml(slice_yaml(workdir))
    need("the Qwen3-30B-A3B slice does not have 2 layers at full width",
         (fields["num_hidden_layers"], fields["hidden_size"], fields["num_experts"], fields["vocab_size"])
         == (2, 2048, 128, 151936))
    on, off = (planned_peak(fields, entropy, local_spec_allowed()) for entropy in (True, False))
    parts = {"weights", "gradients", "optimizer", "activations", "logits", "runtime"}
    need(f"the plan's trainer GPU parts are {sorted(on.parts)}, not {sorted(parts)} and more", parts <= set(on.parts))
    predicted = on.peak - on.parts.get("runtime", 0.0)
    need(f"the slice's planned peak {predicted / GB:.1f} GB is not between 20 and 70 GB (an H100 must hold it, "
         f"1.2x included)", 20 * GB < predicted < 70 * GB)
    need("loss.entropy_coef does not reach the plan's logits", on.parts["logits"] > off.parts["logits"])
    batch = peak_batch(int(fields["vocab_size"]))
    need("plan_vs_peak's batch is not its rows x tokens", tuple(batch.tokens.shape) == (PEAK_ROWS, PEAK_ROW)
         and int(batch.loss_mask.sum()) == PEAK_ROWS * (PEAK_ROW - PEAK_PROMPT))
    seen: dict = {}
    loss_fn = entropy_loss(seen)
    logp, ent = -torch.rand(2, 5), torch.rand(2, 5)
    loss, _ = loss_fn(logp, SimpleNamespace(loss_mask=torch.ones(2, 5)), {"n_valid_tokens": 10.0}, entropy=ent)
    from checks_memory import SENDER_BUCKETS, sender_on_device
    from checks_sender import STALL_AT

    from megarl.launch.runtime_reserve import runtime_parts
    from megarl.trainer.megatron_trainer import MegatronTrainer

    need("plan_vs_peak's sender would stall (SENDER_BUCKETS past the stand-in group's STALL_AT)",
         SENDER_BUCKETS <= STALL_AT and callable(sender_on_device))
    need("MegatronTrainer.save_state missing (plan_vs_peak saves a checkpoint)",
         callable(getattr(MegatronTrainer, "save_state", None)))
    need(f"runtime_parts lacks {_has_params(runtime_parts, 'cfg', 'plan')}",
         not _has_params(runtime_parts, "cfg", "plan"))
    need("plan_vs_peak's loss does not subtract the entropy bonus",
         getattr(loss_fn, "wants_entropy", False) and seen.get("entropy") is True
         and abs(float(loss) - float(-logp.sum() / 10 - 0.01 * ent.sum() / 10)) < 1e-6)


def _publish_memory(need: Need, workdir: Path) -> None:
    from checks_publish import PUBLISH_MODEL, SHM_TOLERANCE, unit_stand_ins

    from megarl.launch.placement import param_counts
    from megarl.models.tiny import load_model_yaml
    from megarl.rollout import publish

    missing = _has_params(publish.BroadcastPublisher.__init__, "trainer", "router", "weights_dir", "backend",
                          "timeout_s")
    need(f"BroadcastPublisher lacks {missing}", not missing)
    for m in ("prepare", "apply", "wait_written", "close", "_sender_device"):
        need(f"BroadcastPublisher.{m} missing", callable(getattr(publish.BroadcastPublisher, m, None)))
    pub = publish.BroadcastPublisher(None, None, workdir / "self_test_weights", backend="gloo", timeout_s=5)
    need("BroadcastPublisher has no bucket_bytes", isinstance(getattr(pub, "bucket_bytes", None), int))
    need("BroadcastPublisher under gloo packs on a device", pub._sender_device() is None)
    pool = getattr(pub, "_pool", None)
    need("BroadcastPublisher's shared-bucket pool has no bytes_allocated / free_bytes()",
         isinstance(getattr(pool, "bytes_allocated", None), int) and callable(getattr(pool, "free_bytes", None)))
    pub.close()
    need("megarl.rollout.publish.release_ipc_blocks missing", callable(getattr(publish, "release_ipc_blocks", None)))
    try:
        stand_in, shmem = unit_stand_ins()
    except Exception as e:  # noqa: BLE001 - reported as the problem it is
        need(f"tests/unit's stand-in engines do not import: {e}", False)
        return
    router = stand_in(1, 1)
    need("TwoWorkerEnginesStandIn has no got / update_weights_from_broadcast / health",
         isinstance(getattr(router, "got", None), dict)
         and all(callable(getattr(router, m, None)) for m in ("update_weights_from_broadcast", "health")))
    need("shmem() does not read /proc/meminfo's Shmem", isinstance(shmem(), int))
    fields = load_model_yaml(derived_yaml(TINY_DENSE, workdir / "self_test_publish.yaml", **PUBLISH_MODEL))
    need("publish_memory's model is too small for its tolerances", param_counts(fields)[0] * 4 > 4 * SHM_TOLERANCE)


def _cuda_ipc(need: Need, workdir: Path) -> None:
    """The packing the check relies on, and its negative control, on CPU (no child process)."""
    import torch
    import torch.multiprocessing
    from checks_publish import corrupted, digest, ipc_buckets, ipc_tensors

    from megarl.rollout import bucket_format

    for fn, names in ((bucket_format.pack, ("bucket", "device", "share")), (bucket_format.unpack, ("meta", "payload")),
                      (bucket_format.group_tensors, ("named_tensors", "bucket_bytes"))):
        need(f"bucket_format.{fn.__name__} lacks {_has_params(fn, *names)}", not _has_params(fn, *names))
    need("torch.cuda.ipc_collect missing", callable(getattr(torch.cuda, "ipc_collect", None)))
    need("torch.multiprocessing.get_context missing", callable(getattr(torch.multiprocessing, "get_context", None)))
    named = ipc_tensors(torch.device("cpu"))
    buckets = ipc_buckets(named, torch.device("cpu"))
    sizes = [payload.numel() for _, _, payload in buckets]
    need(f"cuda_ipc's buckets {sizes}: fewer than 2, or one under its 1 MiB tolerance",
         len(buckets) >= 2 and min(sizes) > MIB)
    expected = {name: digest(t) for name, t in named}
    back = {name: digest(t) for rows, _, payload in buckets for name, t in bucket_format.unpack(rows, payload)}
    need("packed and unpacked tensors do not digest alike", back == expected)
    bad_name, bad_rows, bad = corrupted(buckets)
    changed = sorted(n for n, t in bucket_format.unpack(bad_rows, bad) if digest(t) != expected[n])
    need(f"cuda_ipc's corrupted byte changes the digests of {changed}, not of {bad_name} alone", changed == [bad_name]
         and len(bad_rows) > 1)


def _te_grouped_gemm(need: Need, workdir: Path) -> None:
    import dataclasses

    from megarl.models import build, hf_config
    from megarl.platform.megatron import prepare_megatron

    need("megarl.models.build.grouped_gemm missing", callable(getattr(build, "grouped_gemm", None)))
    need("transformer_config_from_hf takes no grouped_gemm", not _has_params(hf_config.transformer_config_from_hf,
                                                                               "grouped_gemm"))
    prepare_megatron()
    import megatron.core.transformer.moe.experts as experts
    from megatron.core.transformer.transformer_config import TransformerConfig

    need("TransformerConfig has no moe_grouped_gemm",
         "moe_grouped_gemm" in {f.name for f in dataclasses.fields(TransformerConfig)})
    need("megatron has no TEGroupedMLP (te_grouped_gemm looks for modules named *Grouped*)",
         hasattr(experts, "TEGroupedMLP"))


def _ewma_device(need: Need, workdir: Path) -> None:
    """What ewma_device sets and calls: the fold's chunk size, the resident swap, the strategy's phi."""
    import recovery.ewma as ewma_mod
    from megarl.trainer.megatron_trainer import MegatronTrainer

    need("recovery.ewma.FOLD_CHUNK missing (ewma_device shrinks it)", isinstance(getattr(ewma_mod, "FOLD_CHUNK", None),
                                                                                int))
    need("MegatronTrainer.use_params_from takes no resident", not _has_params(MegatronTrainer.use_params_from,
                                                                               "make", "resident"))
    need("Ewma keeps no _phi attribute (ewma_device reads it)",
         "self._phi" in inspect.getsource(ewma_mod.Ewma))


def _bounds(need: Need, workdir: Path) -> None:
    """What pinned_bytes and nccl_init_deadline call and read, and the plan pinned_bytes holds the pool to."""
    import torch
    from checks_bounds import PINNED_HF, pinned_plan

    from megarl.launch.placement import param_counts
    from megarl.rollout.receiver_group import ReceiverGroup
    from megarl.trainer import host_copies

    need("host_copies.host_buffer lacks nbytes / pin", not _has_params(host_copies.host_buffer, "nbytes", "pin"))
    pool = host_copies.HostCopyPool()
    need("HostCopyPool has no held_bytes", isinstance(getattr(pool, "held_bytes", None), int))
    need("torch.cuda.host_memory_stats / cudart missing",
         callable(getattr(torch.cuda, "host_memory_stats", None)) and callable(getattr(torch.cuda, "cudart", None)))
    # snapshot at eta 1: two copies of every parameter in bf16
    need("pinned_bytes' plan is not two bf16 copies of its model", pinned_plan() == 2 * 2 * param_counts(PINNED_HF)[0])
    need("ReceiverGroup has no started flag / check (nccl_init_deadline reads them)",
         "self.started" in inspect.getsource(ReceiverGroup.__init__)
         and callable(getattr(ReceiverGroup, "check", None)))


def _sender_kill(need: Need, workdir: Path) -> None:
    """What sender_kill calls: the sender's constructor, send and kill, its stand-in group built the way the sender
    builds its group, and the IPC release."""
    import inspect as _inspect

    from checks_sender import StallingGroupStandIn, group_info

    from megarl.rollout import broadcast_sender, publish
    from megarl.rollout.weight_sync import WeightBroadcaster

    sender = broadcast_sender.SenderProcess
    need(f"SenderProcess lacks {_has_params(sender.__init__, 'broadcaster_cls', 'device_index')}",
         not _has_params(sender.__init__, "broadcaster_cls", "device_index"))
    need(f"SenderProcess.send lacks {_has_params(sender.send, 'group_info', 'buckets', 'timeout_s')}",
         not _has_params(sender.send, "group_info", "buckets", "timeout_s"))
    need("SenderProcess.kill missing", callable(getattr(sender, "kill", None)))
    need("megarl.rollout.publish.release_ipc_blocks missing", callable(getattr(publish, "release_ipc_blocks", None)))
    kwargs = list(_inspect.signature(WeightBroadcaster.__init__).parameters)
    stand_in = [n for n, p in _inspect.signature(StallingGroupStandIn.__init__).parameters.items()
                if p.kind == p.KEYWORD_ONLY]
    need(f"the stand-in group takes {sorted(set(stand_in) - set(kwargs))}, which WeightBroadcaster does not",
         set(stand_in) <= set(kwargs))
    try:
        broadcast_sender._joined(None, StallingGroupStandIn, {**group_info(), "shards": 1})
    except Exception as e:  # noqa: BLE001 - reported as the problem it is
        need(f"the sender cannot build sender_kill's stand-in group: {type(e).__name__}: {e}", False)
