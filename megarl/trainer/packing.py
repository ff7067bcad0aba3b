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
   (``balanced_bins``). Each is dealt over DP ranks by step 3. A last one deals rows first: each row,
   longest first, to the rank with the least workload, then each rank's rows packed first fit and
   split up to the largest count (``rows_first``; weight-0 dummies where a rank's rows run out). It
   wins where a few giant rows dominate: a rank that holds one takes fewer of the other rows, where
   dealt micro-batches give it as many full ones as the rest. The plan whose heaviest DP rank is
   lightest wins. The others add weight-0 dummies only when the batch has fewer rows than the count.
3. Equal-count Karmarkar-Karp (the largest differencing method with sets of equal size) deals the
   micro-batches over DP ranks on a compute estimate, ``workload``.

Planning is O(n log n) in the rows: heaps, one sort, and a max-tree for the token sums' first fit
(16,384 rows plan in about 0.15 s of one CPU core).

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
from megarl.trainer.partition import karmarkar_karp

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


def _first_fit_sums(order: list[int], lengths: dict[int, int], budget: int) -> list[list[int]]:
    """First fit by token sum in O(n log n): what each group can still take (the budget less its tokens) in a
    max-tree, searched for the first group with room for the row. Groups not opened yet have the whole
    budget, so the first fit of a row no open group takes is the next new group; a row over the budget
    gets the next new group to itself."""
    fit = [n for n in lengths.values() if n <= budget]
    # first fit leaves at most one group half full or less: at most 2 sum / budget + 1 groups of rows that
    # fit, beside one group per row over the budget
    size = min(len(order), len(order) - len(fit) + 2 * sum(fit) // budget + 2)
    leaves = 1 << max(0, size - 1).bit_length()
    tree = [budget] * (2 * leaves)
    groups: list[list[int]] = []
    for r in order:
        n = lengths[r]
        if n <= budget:
            i = 1
            while i < leaves:  # down to the leftmost leaf with room for n
                i += i if tree[2 * i] >= n else i + 1
            g = i - leaves
        else:
            g, i = len(groups), len(groups) + leaves
        if g == len(groups):
            groups.append([])
        groups[g].append(r)
        tree[i] -= n
        i //= 2
        while i:  # the maxima above it
            best = tree[2 * i] if tree[2 * i] >= tree[2 * i + 1] else tree[2 * i + 1]
            if tree[i] == best:
                break
            tree[i] = best
            i //= 2
    return groups


def longest_first(lengths: dict[int, int]) -> list[int]:
    """Row ids longest first, ties by row id (a stable sort keeps the ids' order among equals)."""
    return sorted(sorted(lengths), key=lengths.__getitem__, reverse=True)


def first_fit_decreasing(lengths: dict[int, int], budget: int, layout: str,
                         order: list[int] | None = None) -> list[list[int]]:
    """Row ids packed longest first into the first micro-batch whose cost stays <= ``budget``;
    each group lists its rows longest first (ties by row id). O(n log n): rows come longest first, so a
    rectangle that can take one more row takes every row still to come (one is open at a time), and a
    token sum's first fit is a search of a max-tree (:func:`_first_fit_sums`). ``order``: :func:`longest_first`
    of ``lengths`` when the caller has it."""
    order = longest_first(lengths) if order is None else order
    if layout == "thd":
        return _first_fit_sums(order, lengths, budget)
    groups: list[list[int]] = []
    current = None  # the rectangle that can still take a row
    for r in order:
        if current is None:
            current = len(groups)
            groups.append([])
        groups[current].append(r)
        if (len(groups[current]) + 1) * lengths[groups[current][0]] > budget:
            current = None
    return groups


def _halve(group: list[int], lengths: dict[int, int], layout: str, linear_weight: int) -> tuple[list, list]:
    """Two halves of a group (rows longest first) with loads as even as a greedy deal makes them."""
    halves: tuple[list[int], list[int]] = ([], [])
    sums = [0, 0]  # thd: the sum of the rows' workloads; padded: the rows (the first is the longest)
    for r in group:  # longest first: each row to the lighter half
        loads = [s if layout == "thd" else s * row_workload(lengths[h[0]], linear_weight) if h else 0
                 for s, h in zip(sums, halves)]
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(r)
        sums[side] += row_workload(lengths[r], linear_weight) if layout == "thd" else 1
    return halves


def split_to_multiple(groups: list[list[int]], lengths: dict[int, int], multiple: int, layout: str,
                      linear_weight: int, *, at_least: int = 0) -> list[list[int]]:
    """``groups`` with the heaviest multi-row group split in two until the count is a multiple of
    ``multiple`` and at least ``at_least``, or every group holds one row (splitting never raises a
    group's cost)."""
    groups = [list(g) for g in groups]

    def load(g):
        return group_workload([lengths[r] for r in g], layout, linear_weight)

    loads = [load(g) for g in groups]
    while len(groups) % multiple or len(groups) < at_least:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: (loads[i], -i))
        a, b = _halve(groups[i], lengths, layout, linear_weight)
        groups[i:i + 1] = [a, b]
        loads[i:i + 1] = [load(a), load(b)]
    return groups


def rows_first(lengths: dict[int, int], dp: int, budget: int, layout: str, linear_weight: int,
               order: list[int] | None = None) -> list[list[list[int]]]:
    """Each DP rank's micro-batches when rows are dealt to ranks first: rows longest first, each to the
    rank with the least workload so far, then every rank's rows packed first fit and split up to the
    largest count (weight-0 dummies where a rank's rows cannot be split that far). Where a few giant rows
    dominate, a rank that holds one takes fewer of the others; with micro-batches dealt instead, every
    rank runs as many full micro-batches as the rest beside its giant."""
    heap = [(0, d) for d in range(dp)]
    shares: list[dict[int, int]] = [{} for _ in range(dp)]
    orders: list[list[int]] = [[] for _ in range(dp)]
    for r in longest_first(lengths) if order is None else order:
        load, d = heap[0]
        shares[d][r] = n = lengths[r]
        orders[d].append(r)
        heapq.heapreplace(heap, (load + linear_weight * n + n * n, d))  # row_workload
    packed = [first_fit_decreasing(share, budget, layout, rows) for share, rows in zip(shares, orders)]
    count = max(len(groups) for groups in packed)
    packed = [split_to_multiple(groups, lengths, 1, layout, linear_weight, at_least=count) for groups in packed]
    return [groups + [[] for _ in range(count - len(groups))] for groups in packed]


def balanced_bins(lengths: dict[int, int], count: int, budget: int, layout: str, linear_weight: int,
                  order: list[int] | None = None) -> list[list[int]] | None:
    """Rows longest first into ``count`` micro-batches: the first ``count`` rows one each, every later
    row into the micro-batch whose workload after taking it is least among those it fits in (cost <=
    budget); None when a row fits nowhere. With one micro-batch per DP rank this evens the ranks where
    splitting cannot. Rows come longest first, so a row joining a rectangle never widens it: its
    workload after one more row, (rows + 1) x the longest row's, is known before the row is."""
    order = longest_first(lengths) if order is None else order
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
    aside: list[tuple[int, int]] = []  # thd: (-room, bin) of bins too full for the row before
    for r in order[count:]:
        n = lengths[r]
        while aside and -aside[0][0] >= n:  # rows only get shorter: a bin set aside may take this one
            _, i = heapq.heappop(aside)
            heapq.heappush(heap, (loads[i], i))
        while heap:
            i = heap[0][1]
            rows, top = len(bins[i]), lengths[bins[i][0]]
            if layout == "thd":
                if totals[i] + n > budget:  # the least loaded bin that fits: this one waits for a shorter row
                    heapq.heappush(aside, (totals[i] - budget, heapq.heappop(heap)[1]))
                    continue
            elif (rows + 1) * top > budget:
                heapq.heappop(heap)
                continue  # full for every row to come
            bins[i].append(r)
            totals[i] += n
            loads[i] += row_workload(n, linear_weight) if layout == "thd" else 0
            nxt = loads[i] if layout == "thd" else (rows + 2) * row_workload(top, linear_weight)
            heapq.heapreplace(heap, (nxt, i))
            break
        else:
            return None
    return bins


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
    if not seq_lens:
        raise ValueError("plan_packing got an empty batch (no rows): a step trains at least one row; check "
                         "that the batch was filled before it was planned")
    lengths = {r: int(n) for r, n in enumerate(seq_lens)}
    order = longest_first(lengths)
    work = [row_workload(lengths[r], linear_weight) for r in range(len(lengths))]
    split = split_to_multiple(first_fit_decreasing(lengths, budget, layout, order), lengths, dp, layout,
                              linear_weight)
    best = None
    # candidates in order of preference: the split packing, the balanced one into as many micro-batches
    # and into dp more (micro-batches dealt by Karmarkar-Karp), then rows dealt to ranks first; the one
    # whose heaviest DP rank is lightest wins (ties: the earlier)
    candidates = [(split, None)] + [(balanced_bins(lengths, n, budget, layout, linear_weight, order), None)
                                    for n in (len(split), len(split) + dp) if n <= len(lengths)]
    if dp > 1:
        dealt = rows_first(lengths, dp, budget, layout, linear_weight, order)
        per = len(dealt[0])
        candidates.append(([g for mbs in dealt for g in mbs], [list(range(d * per, (d + 1) * per)) for d in range(dp)]))
    for groups, shares in candidates:
        if groups is None:
            continue
        groups = groups + [[] for _ in range(-len(groups) % dp)]  # dummies: fewer rows than the count needs
        # rows longest first in every group: a rectangle's workload is its row count times its first row's
        weights = [sum(work[r] for r in g) if layout == "thd" else len(g) * work[g[0]] if g else 0
                   for g in groups]
        shares = shares or karmarkar_karp(weights, dp)
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
