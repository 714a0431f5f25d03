"""How forgeax times a call: the one method the bench tool, the benchmark scripts and tuning share.

Compile and warm up outside the measurement; then rounds of `calls` back-to-back calls closed by
`block_until_ready`. Candidates are interleaved round by round with the order reversed every
other round, and a ratio is taken against an anchor timed in the same rounds (docs/performance.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

import jax
import jax.numpy as jnp

from forgeax.core import runtime


def time_call(fn: Callable, args: tuple, *, calls: int, reps: int, warmup: int = 2) -> list[float]:
    """Per-call seconds of `reps` rounds of `calls` back-to-back calls (after a compile and `warmup` calls)."""
    jax.block_until_ready(fn(*args))  # compile
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / calls)
    return rounds


def alternating(names: Sequence[Hashable], rounds: int) -> Iterator[Hashable]:
    """`names`, `rounds` times: round r rotated left by r, reversed on odd rounds (see `interleaved`).
    No name is timed twice in a row across a round boundary, which plain alternation did to the
    first and last names (a back-to-back double run of a heavy call heats the chip: on an H200 it
    made the first candidate of a fwd+bwd attention run 5-9% slower than the same kernel named
    later in the list)."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names) if names else 0
        rotated = names[k:] + names[:k]
        yield from (rotated if r % 2 == 0 else rotated[::-1])


def interleaved(candidates: dict[Hashable, tuple[Callable, tuple]], *, calls: int, rounds: int,
                warmup: int) -> dict[Hashable, list[float]]:
    """Per-call seconds of each candidate `fn(*args)` over `rounds` rounds; a round times every
    candidate once (`time_call`, `calls` calls after `warmup`), in the order `alternating` gives.
    Interleaving spreads clock and thermal drift over every candidate; rotating and reversing
    vary each one's position and neighbours, because a candidate timed right after another runs
    in the state the other left (docs/performance.md, "order effect")."""
    times = {name: [] for name in candidates}
    for name in alternating(list(candidates), rounds):
        fn, args = candidates[name]
        times[name] += time_call(fn, args, calls=calls, reps=1, warmup=warmup)
    return times


def paired_ratios(anchor: Sequence[float], other: Sequence[float]) -> list[float]:
    """anchor / other round by round: the paired statistic (both timed within one round, so the
    clock and power drift between rounds cancels)."""
    return [a / b for a, b in zip(anchor, other)]


def temp_bytes(fn, args) -> float | None:
    """Temporary memory of `fn`'s compiled executable (excludes arguments and outputs)."""
    try:
        return float(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend/runtime reports it
        return None


def copy_bandwidth(calls: int, reps: int) -> float | None:
    """Bytes/s of a large device copy (read + write), the memory ceiling; None on the CPU.

    On the CPU a copy rate is no ceiling: a call whose data fits in the caches outruns a large
    copy to and from DRAM, and a copy small enough to stay in cache would be no ceiling for the
    calls that do not fit."""
    if runtime.current_platform() == "cpu":
        return None
    n = 1 << 28
    x = jnp.arange(n, dtype=jnp.float32)
    rounds = time_call(jax.jit(lambda a: a * 1.0001), (x,), calls=calls, reps=reps)
    return 2 * 4 * n / statistics.median(rounds)
