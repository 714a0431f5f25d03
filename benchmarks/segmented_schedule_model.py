"""A scheduling model (not a measurement) of pallas_gpu's forward with segment ids: one CTA per
tile, which the hardware hands to the next free SM, against the persistent grid, whose tiles are
dealt to the CTAs in tile order at equal weights (`_schedule_weights`; the data is not known when
the table is built).

    python benchmarks/segmented_schedule_model.py

A tile's cost is its key blocks (causal, documents of equal length, 128-row tiles and 128-key
blocks) plus a per-tile overhead of one block (launch, first loads, pipeline ramp), of which the
persistent grid hides 70%. The round robin aliases when #SMs / heads (its stride in query tiles)
sits near a multiple of a document's tiles, so with few query heads some CTAs get only the long
tiles. The model reproduced the direction of the H200 A/B at 32 heads
(results/attention_H200_2026-11-26_persistent_segmented.json) and predicts losses below about 24
heads, where the persistent segmented forward is therefore not used (`_PERSISTENT_SEGMENTED_MIN_HEADS`).
"""

from __future__ import annotations

import heapq

import numpy as np

SMS, OVERHEAD, HIDDEN = 132, 1.0, 0.7


def tile_costs(T: int, N: int, B: int, doc: int, rows: int = 128, blk: int = 128) -> np.ndarray:
    """Key blocks of each forward tile, in tile order (heads fastest, the last query tile first, then batch)."""
    costs = []
    for _ in range(B):
        for i in range(T // rows):
            r0 = (T // rows - 1 - i) * rows
            first = (r0 // doc) * doc // blk  # the document's first key block
            costs += [(r0 + rows - 1) // blk + 1 - first] * N
    return np.array(costs, float)


def per_tile(costs: np.ndarray) -> float:
    """Makespan with each tile on the next free SM."""
    heap = [(0.0, c) for c in range(SMS)]
    for cost in costs:
        t, c = heapq.heappop(heap)
        heapq.heappush(heap, (t + cost + OVERHEAD, c))
    return max(t for t, _ in heap)


def round_robin(costs: np.ndarray) -> float:
    """Makespan with tile t on CTA t mod #SMs (what equal weights give)."""
    load = np.zeros(SMS)
    np.add.at(load, np.arange(len(costs)) % SMS, costs + OVERHEAD * (1 - HIDDEN))
    return float(load.max())


if __name__ == "__main__":
    for T, N, B, doc in [(16384, 32, 1, 512), (16384, 32, 1, 2048), (4096, 32, 4, 1024), (16384, 32, 1, 16384),
                         (16384, 32, 1, 256), (16384, 32, 1, 8192), (16384, 24, 1, 2048), (16384, 16, 1, 2048),
                         (8192, 16, 2, 2048), (16384, 12, 1, 2048), (16384, 8, 1, 2048), (16384, 4, 1, 2048)]:
        costs = tile_costs(T, N, B, doc)
        print(f"T{T} N{N} B{B} documents of {doc}: persistent speedup {per_tile(costs) / round_robin(costs):.2f}x")
