"""The step's metrics across ranks: what every rank's micro-batches measured, merged into one record."""
from __future__ import annotations

import torch.distributed as dist


def reduce_metrics(outputs: list[dict], *, dp: int, pp: int) -> tuple[dict[str, float], float]:
    """Mean of each metric over the real micro-batches of all DP ranks, and the sum of their losses.

    ``outputs`` are this rank's micro-batch results (``loss``, ``metrics``, ``dummy`` for the
    weight-0 padding micro-batches, which are left out). A collective over the data-parallel group;
    with pipeline stages the last stage's result (the only one with losses) goes to every stage.
    """
    from megatron.core import parallel_state as ps  # after init_parallel (megarl/trainer/parallel.py)

    sums: dict[str, list[float]] = {}
    loss_sum = 0.0
    for item in outputs:
        if item.get("dummy"):
            continue
        loss_sum += float(item["loss"])
        for k, v in (item["metrics"] or {}).items():
            s = sums.setdefault(k, [0.0, 0.0])
            s[0] += float(v)
            s[1] += 1.0
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, (sums, loss_sum), group=ps.get_data_parallel_group())
    merged: dict[str, list[float]] = {}
    total = 0.0
    for rank_sums, loss in gathered:
        total += loss
        for k, (v, n) in rank_sums.items():
            m = merged.setdefault(k, [0.0, 0.0])
            m[0] += v
            m[1] += n
    result = [({k: v / n for k, (v, n) in merged.items()}, total)]
    if pp > 1:
        dist.broadcast_object_list(result, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
    return result[0]
