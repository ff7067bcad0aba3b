"""A reshardable save gathers the distributed optimizer on DP rank 0 alone, in host memory.

megatron-core's ``fully_reshardable`` format gathers the distributed optimizer's DP shards into
per-parameter tensors for a save. By default it all-gathers them (over NCCL on a GPU) to every DP rank: each
rank then holds the whole optimizer state of its model shard for the save (12 B per parameter of an fp32
model, twice its 6 B at rest over DP2). With ``distrib_optim_fully_reshardable_mem_efficient`` the shards
are gathered over gloo, to host memory, and only DP rank 0 holds them (megarl/trainer/dist_state.py); the plan
counts that (megarl/launch/save_plan.py). tests/unit/run_save_probe.py measures it on two gloo ranks.

The write is spread (megarl/trainer/sharded_write.py): the weights, replicated over DP, are written by both
DP ranks, not by DP rank 0 alone, and each rank writes several files side by side.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megarl.launch.save_plan import SAVE_GATHER_BYTES_PER_PARAM
from megarl.rollout.client import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from checked_run import run_checked  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_only_dp_rank_0_holds_the_gathered_optimizer_during_a_save(tmp_path):
    from megarl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", tmp_path / "dense", seed=3)
    run_checked([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                 str(REPO / "tests/unit/run_save_probe.py"), "--checkpoint", str(ckpt), "--out",
                 str(tmp_path / "out")], timeout=240)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    check_written(ranks)
    assert all(abs(r["at_rest"] - 6.0) < 0.1 for r in ranks), ranks  # the probe sees the optimizer's shard
    # DP rank 0 holds the gathered state (the plan's term), the other DP ranks nothing beyond their shard
    assert abs(ranks[0]["bytes_per_param"] - SAVE_GATHER_BYTES_PER_PARAM) < 0.1, ranks
    assert ranks[1]["bytes_per_param"] < 0.1, \
        f"DP rank 1 holds {ranks[1]['bytes_per_param']:.2f} B per parameter for a save (the whole optimizer)"


def check_written(ranks: list) -> None:
    """Both DP ranks write a share of the weights, each in several files."""
    sizes = [sum(r["written"]) for r in ranks]
    # rank 0 writes the gathered optimizer (12 B per parameter) and its share of the weights (4 B); rank 1 the rest
    assert sizes[1] > 0.25 * sizes[0] / 4, f"DP rank 1 wrote {sizes[1]} bytes against DP rank 0's {sizes[0]}"
    assert all(len(r["written"]) > 1 for r in ranks), [r["written"] for r in ranks]
