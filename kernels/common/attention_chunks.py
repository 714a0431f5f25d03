"""Chunks of query heads for attention backwards whose workspace grows with the heads.

A backward that stores a per-head workspace for every head at once (the dz^T tiles of the
pallas_gpu and Triton dq-from-dz^T backwards: O(T * S) bytes per head) may instead run its
launches one chunk of query heads at a time, the chunks taking turns in one buffer. Query head
n reads kv head n // G (G = N // K); a chunk is the query heads g0 .. g0 + g - 1 of each group
of the kv heads k0 .. k0 + kv - 1. Splitting a group across chunks makes its dk/dv sums span
launches (carried in f32: `HeadChunk.carry_in` / `carry_out`); splitting the kv heads shrinks
each dK/dV launch's grid (one program per key block of each of the chunk's kv heads).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HeadChunk:
    """The query heads one pair of backward launches covers (`head_chunks`): of kv heads
    [k0, k0 + kv), the query heads [g0, g0 + g) of each group of G."""

    k0: int
    kv: int
    g0: int
    g: int
    G: int

    @property
    def heads(self) -> int:
        return self.kv * self.g

    @property
    def carry_in(self) -> bool:  # dk/dv start from the previous chunk's f32 sums
        return self.g0 > 0

    @property
    def carry_out(self) -> bool:  # the group continues in the next chunk
        return self.g0 + self.g < self.G

    @property
    def whole(self) -> bool:
        return self.g == self.G


def head_chunks(B: int, K: int, G: int, key_tiles: int, head_bytes: int, budget: int,
                min_tiles: int) -> list[HeadChunk] | None:
    """The fewest chunks of query heads whose workspace (head_bytes per query head, all B
    batches) fits `budget` each, None if none does. Groups split before kv heads (a split group
    costs an f32 dk/dv round trip, a kv split shrinks the dK/dV grid); kv heads split only while
    a chunk keeps kv * key_tiles * B >= min_tiles dK/dV work items (key_tiles per kv head and
    batch: under a causal band the first key blocks take many more steps than the last, and
    few items leave SMs idle behind the longest). Among chunks of as many heads, the one with
    more of each group. The chunks of one kv range come in group order (their sums carry)."""
    divisors = lambda n: [d for d in range(n, 0, -1) if n % d == 0]
    best = None
    for kv in divisors(K):
        if kv != K and kv * key_tiles * B < min_tiles:
            continue
        for g in divisors(G):
            if kv * g * head_bytes <= budget and (best is None or (kv * g, g) > (best[0] * best[1], best[1])):
                best = (kv, g)
    if best is None:
        return None
    kv, g = best
    return [HeadChunk(k0, kv, g0, g, G) for k0 in range(0, K, kv) for g0 in range(0, G, g)]
