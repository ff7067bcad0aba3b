"""Equal-count number partitioning: Karmarkar-Karp's largest differencing method with sets of equal size.

megarl/trainer/packing.py deals micro-batches over DP ranks with it (every rank runs the same count).
"""
from __future__ import annotations

import heapq


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
        merged.sort(key=lambda s: (-s[0], min(s[1])))  # disjoint sets: the smallest index orders them
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(id1, id2), merged))
    _, _, sets = heap[0]
    return sorted((sorted(s[1]) for s in sets), key=lambda s: s[0])
