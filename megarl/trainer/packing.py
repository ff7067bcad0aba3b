"""The packing plan: which rows form which micro-batch, and which DP rank runs it.

Every rank computes the whole plan from the batch's row lengths alone (pure, deterministic
functions, no collective) and keeps its own share. Three steps:

1. First-fit-decreasing: rows, longest first, go into the first micro-batch whose token cost stays
   within the budget (``micro_batch_tokens``). The cost depends on the layout: ``padded`` runs a
   rectangle, so a micro-batch costs ``rows * longest``; ``thd`` concatenates rows, so it costs the
   sum of their lengths. A row longer than the budget gets a micro-batch of its own.
2. The count is rounded up to a multiple of ``dp`` (every DP rank runs the same number of
   micro-batches: expert parallelism exchanges tokens inside every layer) by splitting the
   heaviest micro-batches in two. Two more packings compete with that one: rows dealt longest
   first into as many micro-batches, and into dp more, each row to the micro-batch it loads least
   (``balanced_bins``); the plan whose heaviest DP rank is lightest wins. Only when the batch has
   fewer rows than the count are weight-0 dummies added.
3. Equal-count Karmarkar-Karp (the largest differencing method with sets of equal size) deals the
   micro-batches over DP ranks on a compute estimate, ``workload``.

One plan serves both layouts; megarl/trainer/layouts.py builds each micro-batch's tensors.

Workload estimate. A row of L tokens costs ``c_lin * L`` for its projections and MLP plus
``c_quad * L^2`` for its attention scores; megarl uses ``linear_weight * L + L^2``, i.e. the ratio
``linear_weight = c_lin / c_quad``. Per layer and token, the dense matmuls cost 2 FLOPs per
weight: ``2 * (h * (q + 2 kv) + q * h + 3 * h * ffn)`` (QKV, output projection, SwiGLU MLP); the
attention scores and their weighted sum cost ``2 * 2 * q`` per pair of positions and a causal
mask keeps half of the pairs, so ``c_quad = 2 q`` per token pair. :func:`linear_weight_for`
derives the ratio from a checkpoint's config (the trainer uses its model's); ``DEFAULT_LINEAR_WEIGHT``
is its value for Qwen3-8B's shape (hidden 4096, MLP 12288, 32 query and 8 KV heads of 128).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from megarl.errors import ConfigError

#: linear_weight_for(hidden=4096, ffn=12288, q_width=4096, kv_width=1024) (module doc)
DEFAULT_LINEAR_WEIGHT = 47104
LAYOUTS = ("padded", "thd")


def linear_weight_for(hidden: int, ffn: int, q_width: int, kv_width: int) -> int:
    """``c_lin / c_quad`` of the workload estimate (module doc): per-token matmul FLOPs over per-pair
    attention FLOPs. ``q_width`` = heads x head_dim, ``kv_width`` = KV heads x head_dim."""
    c_lin = 2 * (hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * ffn)
    c_quad = 2 * q_width
    return max(1, round(c_lin / c_quad))


def linear_weight_from_hf(hf: dict) -> int:
    """:func:`linear_weight_for` of a Hugging Face config (Qwen3 / Qwen3-MoE keys; the MoE MLP counts
    the experts one token runs through)."""
    hidden = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // int(hf["num_attention_heads"]))
    heads, kv = int(hf["num_attention_heads"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    if hf.get("num_experts"):
        ffn = int(hf["moe_intermediate_size"]) * int(hf.get("num_experts_per_tok", 1))
    else:
        ffn = int(hf["intermediate_size"])
    return linear_weight_for(hidden, ffn, heads * head_dim, kv * head_dim)


def row_workload(length: int, linear_weight: int) -> int:
    """Compute estimate of one row of ``length`` tokens (module doc)."""
    return linear_weight * length + length * length


def group_cost(lengths: list[int], layout: str) -> int:
    """Tokens a micro-batch of rows with ``lengths`` occupies in ``layout``."""
    if not lengths:
        return 0
    return sum(lengths) if layout == "thd" else len(lengths) * max(lengths)


def group_workload(lengths: list[int], layout: str, linear_weight: int) -> int:
    """Compute estimate of one micro-batch: a rectangle computes its padding too."""
    if not lengths:
        return 0
    if layout == "thd":
        return sum(row_workload(n, linear_weight) for n in lengths)
    return len(lengths) * row_workload(max(lengths), linear_weight)


def first_fit_decreasing(lengths: dict[int, int], budget: int, layout: str) -> list[list[int]]:
    """Row ids packed longest first into the first micro-batch whose cost stays <= ``budget``;
    each group lists its rows longest first (ties by row id)."""
    groups: list[list[int]] = []
    fill: list[tuple[int, int]] = []  # rows and token sum of each group (its first row is its longest)
    shortest = min(lengths.values(), default=0)
    open_ids: list[int] = []  # groups that can still take the shortest row
    for r in sorted(lengths, key=lambda r: (-lengths[r], r)):
        n = lengths[r]
        for pos in range(len(open_ids)):
            g = open_ids[pos]
            rows, total = fill[g]
            if (total + n if layout == "thd" else (rows + 1) * lengths[groups[g][0]]) <= budget:
                groups[g].append(r)
                fill[g] = (rows + 1, total + n)
                break
        else:
            g, pos = len(groups), len(open_ids)
            groups.append([r])
            fill.append((1, n))
            open_ids.append(g)
        rows, total = fill[g]
        if (total + shortest if layout == "thd" else (rows + 1) * lengths[groups[g][0]]) > budget:
            del open_ids[pos]  # full for every row still to come
    return groups


def _halve(group: list[int], lengths: dict[int, int], layout: str, linear_weight: int) -> tuple[list, list]:
    """Two halves of a group (rows longest first) with loads as even as a greedy deal makes them."""
    a: list[int] = []
    b: list[int] = []
    for r in group:  # longest first: each row to the lighter half
        la = group_workload([lengths[x] for x in a], layout, linear_weight)
        lb = group_workload([lengths[x] for x in b], layout, linear_weight)
        (a if la <= lb else b).append(r)
    return a, b


def split_to_multiple(groups: list[list[int]], lengths: dict[int, int], multiple: int, layout: str,
                      linear_weight: int) -> list[list[int]]:
    """``groups`` with the heaviest multi-row group split in two until the count is a multiple of
    ``multiple`` or every group holds one row (splitting never raises a group's cost)."""
    groups = [list(g) for g in groups]

    def load(g):
        return group_workload([lengths[r] for r in g], layout, linear_weight)

    loads = [load(g) for g in groups]
    while len(groups) % multiple:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (loads[i], -i))
        a, b = _halve(groups[i], lengths, layout, linear_weight)
        groups[i:i + 1] = [a, b]
        loads[i:i + 1] = [load(a), load(b)]
    return groups


def balanced_bins(lengths: dict[int, int], count: int, budget: int, layout: str,
                  linear_weight: int) -> list[list[int]] | None:
    """Rows longest first into ``count`` micro-batches: the first ``count`` rows one each, every later
    row into the micro-batch whose workload after taking it is least among those it fits in (cost <=
    budget); None when a row fits nowhere. With one micro-batch per DP rank this evens the ranks where
    splitting cannot. Rows come longest first, so a row joining a rectangle never widens it: its
    workload after one more row, (rows + 1) x the longest row's, is known before the row is."""
    order = sorted(lengths, key=lambda r: (-lengths[r], r))
    if count < 1 or count > len(order):
        return None
    bins = [[r] for r in order[:count]]
    heap = []  # (workload after one more row, bin) of the bins that may still take one
    for i, (r,) in enumerate(bins):
        n = lengths[r]
        heap.append(((row_workload(n, linear_weight) * (1 if layout == "thd" else 2), i)))
    heapq.heapify(heap)
    totals = [lengths[b[0]] for b in bins]
    loads = [row_workload(t, linear_weight) for t in totals]
    for r in order[count:]:
        n, aside = lengths[r], []
        while heap:
            key, i = heapq.heappop(heap)
            rows, top = len(bins[i]), lengths[bins[i][0]]
            if layout == "thd":
                key = loads[i]  # the same row adds the same workload anywhere: the least loaded bin that fits
                if totals[i] + n > budget:
                    aside.append((key, i))  # a shorter row may fit later
                    continue
            elif (rows + 1) * top > budget:
                continue  # full for every row to come
            bins[i].append(r)
            totals[i] += n
            loads[i] += row_workload(n, linear_weight) if layout == "thd" else 0
            nxt = loads[i] if layout == "thd" else (rows + 2) * row_workload(top, linear_weight)
            heapq.heappush(heap, (nxt, i))
            break
        else:
            return None
        for item in aside:
            heapq.heappush(heap, item)
    return bins


def karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` sets of equal size (``len(weights) % k == 0``) with sums
    as even as the largest differencing method makes them. Deterministic: ties go by index."""
    if k < 1 or len(weights) % k:
        raise ValueError(f"karmarkar_karp needs a count divisible by k={k}, got {len(weights)} weights")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    heap: list = []
    for start in range(0, len(order), k):
        # one partial partition: k sets of one item each, sorted by sum (largest first)
        sets = [(weights[i], [i]) for i in order[start:start + k]]
        sets.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), start, sets))
    while len(heap) > 1:
        _, id1, s1 = heapq.heappop(heap)
        _, id2, s2 = heapq.heappop(heap)
        # largest set of one with the smallest of the other: the spreads cancel
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(s1, reversed(s2))]
        merged.sort(key=lambda s: (-s[0], sorted(s[1])))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(id1, id2), merged))
    _, _, sets = heap[0]
    return sorted((sorted(s[1]) for s in sets), key=lambda s: s[0])


@dataclass
class PackingPlan:
    """The whole batch's plan: ``ranks[d]`` lists DP rank d's micro-batches, each a list of row ids
    (longest first; an empty list is a weight-0 dummy)."""

    ranks: list[list[list[int]]]
    layout: str
    budget: int

    def workloads(self, lengths: list[int], linear_weight: int = DEFAULT_LINEAR_WEIGHT) -> list[int]:
        """Compute estimate of each DP rank."""
        return [sum(group_workload([lengths[r] for r in g], self.layout, linear_weight) for g in mbs)
                for mbs in self.ranks]

    def padding_share(self, lengths: list[int]) -> float:
        """Padding tokens over all tokens the micro-batches occupy."""
        occupied = sum(group_cost([lengths[r] for r in g], self.layout) for mbs in self.ranks for g in mbs)
        real = sum(lengths[r] for mbs in self.ranks for g in mbs for r in g)
        return 1.0 - real / occupied if occupied else 0.0


def plan_packing(seq_lens: list[int], dp: int, budget: int, *, layout: str = "padded",
                 linear_weight: int = DEFAULT_LINEAR_WEIGHT) -> PackingPlan:
    """The plan of a batch with rows of ``seq_lens`` tokens over ``dp`` ranks (module doc)."""
    if layout not in LAYOUTS:
        raise ValueError(f"packing layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if dp < 1 or budget < 1:
        raise ValueError(f"plan_packing needs dp >= 1 and budget >= 1, got dp={dp}, budget={budget}")
    lengths = {r: int(n) for r, n in enumerate(seq_lens)}
    split = split_to_multiple(first_fit_decreasing(lengths, budget, layout), lengths, dp, layout, linear_weight)
    best = None
    # candidates in order of preference: the split packing, the balanced one into as many micro-batches
    # and into dp more; the one whose heaviest DP rank is lightest wins (ties: the earlier)
    candidates = [split] + [balanced_bins(lengths, n, budget, layout, linear_weight)
                            for n in (len(split), len(split) + dp) if n <= len(lengths)]
    for groups in candidates:
        if groups is None:
            continue
        groups = groups + [[] for _ in range(-len(groups) % dp)]  # dummies: fewer rows than the count needs
        weights = [group_workload([lengths[r] for r in g], layout, linear_weight) for g in groups]
        shares = karmarkar_karp(weights, dp)
        heaviest = max(sum(weights[i] for i in share) for share in shares)
        if best is None or heaviest < best[0]:
            best = (heaviest, groups, weights, shares)
    _, groups, weights, shares = best
    ranks = []
    for share in shares:
        # by longest row id on each rank, dummies last: at dp=1 the order depends on the packing alone
        share.sort(key=lambda i: (not groups[i], groups[i][:1]))
        ranks.append([groups[i] for i in share])
    # rank order: by the smallest row each holds, so rank 0's share does not depend on heap ties
    ranks.sort(key=lambda mbs: min((r for g in mbs for r in g), default=len(seq_lens)))
    return PackingPlan(ranks=ranks, layout=layout, budget=budget)


def round_robin_plan(seq_lens: list[int], dp: int, budget: int) -> PackingPlan:
    """The plan megarl used before :func:`plan_packing` (for comparison, megarl bench --packing): row i on
    DP rank i % dp, rows packed longest first into rectangles, every rank filled up with dummies to the
    largest count."""
    ranks = []
    for d in range(dp):
        rows = {r: int(seq_lens[r]) for r in range(d, len(seq_lens), dp)}
        groups: list[list[int]] = []
        for r in sorted(rows, key=lambda r: (-rows[r], r)):
            if groups and (len(groups[-1]) + 1) * rows[groups[-1][0]] <= budget:
                groups[-1].append(r)
            else:
                groups.append([r])
        ranks.append(groups)
    count = max(len(g) for g in ranks)
    return PackingPlan(ranks=[g + [[] for _ in range(count - len(g))] for g in ranks], layout="padded", budget=budget)


def resolve_layout(packing: str, transformer_engine: bool) -> str:
    """The layout ``trainer.packing`` asks for (megarl/trainer/layouts.py): ``auto`` is ``thd`` exactly
    when the TransformerEngine spec is in use, ``padded`` otherwise; ``thd`` needs TransformerEngine."""
    if packing == "auto":
        return "thd" if transformer_engine else "padded"
    if packing == "padded":
        return "padded"
    if packing == "thd":
        if not transformer_engine:
            raise ConfigError("trainer.packing=thd needs TransformerEngine attention (a CUDA device with "
                              "transformer_engine installed): megatron-core's local layers refuse packed "
                              "sequences; set trainer.packing=auto or padded")
        return "thd"
    raise ConfigError(f"trainer.packing {packing!r} is not one of auto, thd, padded")
