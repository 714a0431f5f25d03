"""Building blocks of the warp-specialised Mosaic GPU kernels (Hopper).

Every kernel in kernels/pallas/gpu/attention_forward.py and attention_backward_kernels.py, and
the gated MLP's warp-specialised forward (gated_mlp.py), has one shape of CTA: `WGS` consumer
warpgroups of `ROWS` rows each (the wgmma M; `CTA` rows together) and one producer warpgroup
that streams operands into a ring of SMEM slots by TMA. What they share lives here:
  * `named_barrier`, `SlotFree`, `PingPong`: synchronisation on hardware named barriers (and the
    mbarriers that stand in for them in interpret mode);
  * `balance`, `Schedule`: one CTA per tile, or a persistent grid (one CTA per SM) running the
    tiles a balanced table gives it, in tile order;
  * `Mma`: acc + a @ b on the tensor cores, with the several-wgmmas-per-wait forms the kernels
    use, and its interpret-mode fallbacks (register LHS staged through SMEM);
  * `launch`: the plgpu.kernel of such a CTA (optionally in clusters of CTAs, `CLUSTER_AXIS`).
One-warpgroup matmul kernels (newton_schulz) use `tma_wgmma_loop` (the TMA ring -> wgmma K loop)
and `one_warpgroup_kernel` (their plgpu.kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from forgeax.core.runtime import gpu_sm_count, interpret_enabled
from forgeax.kernels.pallas.gpu import interpret_params, kernel_axis
from forgeax.kernels.pallas.interpret import without_effects

F32 = jnp.float32
ROWS = 64  # rows per consumer warpgroup (the wgmma M)
WGS = 2  # consumer warpgroups per CTA
CTA = ROWS * WGS
WG_AXIS = kernel_axis("wg")  # the warpgroup (thread) axis of a `launch` CTA

INTERPRET_CTAS = 2  # interpret mode: two CTAs, most with several tiles (uneven counts)
# Registers per thread of the consumer and producer warpgroups: 2 x 240 + 24 fills the 64K. At
# 232 + 40 ptxas spilled in the overlapped forward (12 bytes) and in a backward kernel (48 bytes).
REGS = (240, 24)
FIRST_NAMED_BARRIER = 4  # Mosaic GPU uses 0 (CTA) and 1..num_threads (one per warpgroup)
WG_THREADS = 128


def i32(x):
    return jnp.asarray(x, jnp.int32)


def transforms(dtype, swizzle=128):
    # wgmma's K must be a multiple of swizzle / itemsize: 64-byte swizzle for 32-wide K blocks.
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def compiler_params(row_reductions_only: bool = False):
    """row_reductions_only: the kernel reduces only within rows of WGMMA-layout arrays (a
    quad's registers, no SMEM), so Pallas need not reserve its cross-warp reduction scratch
    (2 KB: what the flat forward's 224 KB of buffers have no room for)."""
    return plgpu.CompilerParams(approx_math=True, **(dict(reduction_scratch_bytes=0) if row_reductions_only else {}))


# ----------------------------------------------------------------------------- synchronisation


def named_barrier(op: str, barrier_id, threads: int):
    """PTX `bar.arrive` (does not block) or `bar.sync` (blocks) on a hardware named barrier,
    which completes once `threads` threads have arrived or synced on it."""
    if isinstance(barrier_id, int):
        plgpu.inline_mgpu()(lambda _: mgpu.utils.inline_ptx(
            f"bar.{op} {barrier_id}, {threads};", has_side_effects=True, convergent=True))()
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
    def emit(_, bid):
        mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", bid.registers[()], has_side_effects=True, convergent=True)

    emit(i32(barrier_id))


class SlotFree:
    """'This ring slot may be refilled': the consumer warpgroups release a slot after their last
    read of it, the producer acquires it before the TMA that overwrites it.

    Named barriers (the forward on the GPU): one per slot, counting 128 threads per consumer plus
    the producer's 128; the consumers pre-release the first `stages` slots so the producer
    acquires before every load, and release use i only when a load i + stages follows, so
    arrivals and syncs pair up exactly. Otherwise an mbarrier per slot that the producer waits on
    from load `stages` on: interpret mode has no named barriers, and the backward kernels
    measured slower with them (docs/performance.md).
    """

    def __init__(self, bars, stages: int, first_id: int, named: bool):
        self.bars, self.stages, self.first_id, self.named = bars, stages, first_id, named

    @property
    def next_id(self) -> int:
        return self.first_id + (self.stages if self.named else 0)

    def _arrive(self, slot):
        if self.named:
            named_barrier("arrive", self.first_id + slot, WG_THREADS * (WGS + 1))
        else:
            plgpu.barrier_arrive(self.bars.at[slot])

    def prime(self, loads):
        """Consumers, before their loop over `loads` uses of the ring."""
        if self.named:
            for slot in range(self.stages):
                pl.when(slot < loads)(functools.partial(self._arrive, slot))

    def release(self, slot, i, loads):
        pl.when(i + self.stages < loads)(lambda: self._arrive(slot))

    def acquire(self, slot, i):
        if self.named:
            named_barrier("sync", self.first_id + slot, WG_THREADS * (WGS + 1))
        else:
            pl.when(i >= self.stages)(lambda: plgpu.barrier_wait(self.bars.at[slot]))


class PingPong:
    """FA3's ping-pong between the two consumer warpgroups, on two named barriers: `turn()` waits
    until the other WG has handed the tensor cores over (`handover()`, which never blocks), so one
    WG runs its softmax while the other's matmuls run. Scheduling only (no data depends on it):
    a no-op in interpret mode, which has no named barriers."""

    def __init__(self, wg, first_id: int, enabled: bool):
        self.wg, self.first_id, self.enabled = wg, first_id, enabled

    def turn(self):
        if self.enabled:
            named_barrier("sync", self.first_id + self.wg, 2 * WG_THREADS)

    def handover(self):
        if self.enabled:
            named_barrier("arrive", self.first_id + 1 - self.wg, 2 * WG_THREADS)

    def realign(self):
        """Both consumers meet (persistent grid, before each tile). Without it, WG 0 could hand
        over at the end of one tile and again in the next before WG 1's matching turn, and a
        named barrier would count those two arrivals as one completed phase."""
        if self.enabled:
            named_barrier("sync", self.first_id + 2, 2 * WG_THREADS)



# ----------------------------------------------------------------------------- tile schedules


def unravel(t, dims):
    """Tile id -> one index per axis of `dims`, the first axis fastest."""
    idx = []
    for d in dims[:-1]:
        idx.append(lax.rem(t, i32(d)))
        t = lax.div(t, i32(d))
    return (*idx, t)


def balance(steps: np.ndarray, ctas: int) -> np.ndarray:
    """Tiles to CTAs in tile order, each to the CTA with the least work so far (its tiles' ring
    uses plus one each for the prologue/epilogue; ties to the lower CTA): what the hardware does
    with one CTA per tile, known ahead. In tile order (heads fastest, then query blocks) the ~#SMs
    tiles running at one time are a few query blocks of every head of one batch, so each head's
    K/V is read by several of them at about the same time (L2 reuse); longest-first (LPT) order
    loses that reuse and round robin leaves causal lengths unbalanced, both measured slower
    (docs/performance.md).
    Returns [ctas, 1 + R] int32: each CTA's tile count, then its tile ids in the order to run."""
    heap = [(0, c) for c in range(ctas)]
    lists = [[] for _ in range(ctas)]
    for t in range(len(steps)):
        work, c = heapq.heappop(heap)
        lists[c].append(t)
        heapq.heappush(heap, (work + int(steps[t]) + 1, c))
    table = np.zeros((ctas, 1 + max(map(len, lists))), np.int32)
    for c, ts in enumerate(lists):
        table[c, 0] = len(ts)
        table[c, 1:1 + len(ts)] = ts
    return table


TILE_AXES = tuple(map(kernel_axis, ("heads", "rows", "batch")))  # one CTA per tile
CTA_AXIS = kernel_axis("cta")  # persistent grid


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which tiles a CTA runs. One CTA per tile: the grid is the tiles' (heads, row tiles, batch)
    and a tile is its grid indices. Persistent (ctas = #SMs, grid axis CTA_AXIS): the tiles
    `balance` gives the CTA, by id (heads fastest), read from a table input."""

    dims: tuple[int, int, int]
    ctas: int
    table: np.ndarray | None

    @classmethod
    def of(cls, steps_of, dims: tuple[int, int, int], persistent: bool, interpret: bool, cluster: int = 1) -> Schedule:
        """steps_of(tile id) -> the tile's ring uses (traceable, evaluated here for every tile).
        cluster: CTAs per cluster, which run each tile together (the grid then counts clusters)."""
        tiles = math.prod(dims)
        ctas = min(tiles, max(1, (INTERPRET_CTAS if interpret else gpu_sm_count()) // cluster))
        if not persistent or ctas == tiles:
            return cls(dims, tiles, None)
        with jax.ensure_compile_time_eval():
            steps = np.asarray(jax.vmap(steps_of)(jnp.arange(tiles, dtype=jnp.int32)))
        return cls(dims, ctas, balance(steps, ctas))

    @property
    def grid(self) -> dict:
        """plgpu.kernel's grid arguments."""
        if self.table is None:
            return dict(grid=self.dims, grid_names=TILE_AXES)
        return dict(grid=(self.ctas,), grid_names=(CTA_AXIS,))

    def input(self) -> jax.Array:
        """The table, an extra kernel input (a placeholder when there is none)."""
        return jnp.asarray(np.zeros((1, 1), np.int32) if self.table is None else self.table)

    def run(self, table_ref, body):
        """body(kk, tile, base) -> base + the ring uses of that tile, over this CTA's tiles
        (base: the ring uses of its earlier tiles, so ring slots and barrier phases carry on)."""
        if self.table is None:
            return body(i32(0), self.tile(table_ref, 0), i32(0))
        cta = lax.axis_index(CTA_AXIS)
        return lax.fori_loop(0, self.count(table_ref), lambda kk, base: body(kk, table_ref[cta, kk + 1], base), i32(0))

    def total(self, table_ref, steps_of):
        """Ring uses of all this CTA's tiles."""
        return self.run(table_ref, lambda kk, t, base: base + steps_of(t))

    def count(self, table_ref):
        """How many tiles this CTA runs."""
        return 1 if self.table is None else table_ref[lax.axis_index(CTA_AXIS), 0]

    def has_next(self, table_ref, kk):
        return kk + 1 < self.count(table_ref)

    def tile(self, table_ref, kk):
        """The kk-th tile of this CTA: its grid indices (one CTA per tile, so the kernel divides
        no tile id) or its id."""
        if self.table is None:
            return tuple(lax.axis_index(name) for name in TILE_AXES)
        return table_ref[lax.axis_index(CTA_AXIS), kk + 1]


# ----------------------------------------------------------------------------- wgmma


class Mma:
    """acc + a @ b on the tensor cores; `a` an SMEM ref or a 16-bit register array (WGMMA layout).

    On the GPU a register LHS feeds wgmma directly and the accumulator is updated in place
    (`run_state` + `ACC.init`). In interpret mode (which supports neither) a register LHS is
    staged through `stage` (this WG's SMEM buffer) and the product is added to acc.
    """

    def __init__(self, interpret: bool, stage=None):
        self.interpret, self.stage = interpret, stage

    def __call__(self, a, b, shape, acc=None, a_in_regs=False, after_issue=None):
        if a_in_regs and self.interpret:
            self.stage[...] = a
            plgpu.commit_smem()
            a = self.stage
        if self.interpret or acc is None:
            def run(acc_ref):
                plgpu.wgmma(acc_ref, a, b)
                if after_issue is not None:  # runs while the wgmma is in flight
                    after_issue()
                return acc_ref[...]

            out = pl.run_scoped(run, plgpu.ACC(shape, F32))
            return out if acc is None else acc + out

        def update(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if after_issue is not None:
                after_issue()

        return pl.run_state(update)(plgpu.ACC.init(acc))

    def two(self, acc, a, b, a2, b2, shape2):
        """(acc + a @ b, a2 @ b2) with a in registers: on the GPU both wgmmas are issued before
        one wait (one wgmma.wait_group instead of two)."""
        if self.interpret:
            return self(a, b, acc.shape, acc=acc, a_in_regs=True), self(a2, b2, shape2)

        def update(refs):
            plgpu.wgmma(refs[0], a, b)
            plgpu.wgmma(refs[1], a2, b2)

        return pl.run_state(update)((plgpu.ACC.init(acc), plgpu.ACC.init(zeros(shape2))))

    def fresh(self, products, shape):
        """[a @ b for (a, b) in products], SMEM operands: on the GPU all issued before one wait."""
        if self.interpret:
            return [self(a, b, shape) for a, b in products]

        def run(*refs):
            for ref, (a, b) in zip(refs, products):
                plgpu.wgmma(ref, a, b)
            return tuple(ref[...] for ref in refs)

        return pl.run_scoped(run, *[plgpu.ACC(shape, F32) for _ in products])

    def update(self, items):
        """[acc + a @ b for (acc, a, b) in items], a in registers: on the GPU all issued before one wait."""
        if self.interpret:
            return [self(a, b, acc.shape, acc=acc, a_in_regs=True) for acc, a, b in items]

        def run(refs):
            for ref, (_, a, b) in zip(refs, items):
                plgpu.wgmma(ref, a, b)

        return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc, _, _ in items))

    def overlapped(self, a, b, shape, a2, b2, acc2, between, init, after_issue=None):
        """(acc2 + a2 @ b2, between(a @ b)), a2 in registers: on the GPU both wgmmas are issued
        (a @ b first), `after_issue` runs, and `between` runs on a @ b while a2 @ b2 is still in
        flight (FA3's intra-warpgroup overlap). `init` is shaped like between's result."""
        if self.interpret:
            s = self(a, b, shape)
            acc2 = self(a2, b2, acc2.shape, acc=acc2, a_in_regs=True)
            if after_issue is not None:
                after_issue()
            return acc2, between(s)

        def body(refs):
            acc_ref, out_refs = refs

            def first(s_ref):
                plgpu.wgmma(s_ref, a, b)
                plgpu.wgmma(acc_ref, a2, b2)
                if after_issue is not None:
                    after_issue()
                return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # a @ b only

            out = between(pl.run_scoped(first, plgpu.ACC(shape, F32)))
            for ref, value in zip(jax.tree.leaves(out_refs), jax.tree.leaves(out)):
                ref[...] = value

        return pl.run_state(body)((plgpu.ACC.init(acc2), init))


def warp_specialized(wg, schedule: Schedule, table_ref, consumer, producer):
    """A kernel's two roles over the CTA's tiles (`Schedule.run`): the `WGS` consumer warpgroups
    take `REGS[0]` registers, run consumer()'s tile body and wait for their last TMA stores; the
    producer warpgroup gives registers back down to `REGS[1]` and runs producer()'s. consumer and
    producer are called inside their role, so the set-up code they run before returning their
    tile body is traced there. A consumer that runs the CTA's tiles itself (one loop across
    them) returns None."""

    @pl.when(wg < WGS)
    def _consumer():
        plgpu.set_max_registers(REGS[0], action="increase")
        body = consumer()
        if body is not None:
            schedule.run(table_ref, body)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == WGS)
    def _producer():
        plgpu.set_max_registers(REGS[1], action="decrease")
        schedule.run(table_ref, producer())


def k_block(step, size: int):
    """The `size`-wide K slice of ring step `step` (a Python int or a traced index)."""
    return pl.ds(step * size if isinstance(step, int) else pl.multiple_of(step * size, size), size)


def tma_wgmma_loop(fetch, issue, steps, stages: int, loaded, prepare=None):
    """The K loop of a one-warpgroup matmul over a `stages`-deep TMA ring: fetch(step, slot)
    issues the TMA copies of K step `step` onto `loaded[slot]`, issue(slot) the wgmmas that read
    the slot. The prologue fills the ring; `wgmma_wait(1)` after step k's wgmmas retires step
    k-1's, whose slot is then refilled with step k-1+stages (refilling the slot a wgmma still
    reads is a race only the GPU shows). The caller's `acc[...]` waits for the last wgmmas.
    steps: a Python int, or a traced count (the prologue's copies then run under pl.when).
    prepare(slot, k), if given, runs once step k's copies have landed, before its wgmmas (e.g.
    masking rows of the slot in SMEM; it must end with plgpu.commit_smem())."""
    if isinstance(steps, int):
        for s in range(min(stages, steps)):
            fetch(s, s)
    else:
        for s in range(stages):
            pl.when(s < steps)(functools.partial(fetch, s, s))

    def step(k, _):
        slot = lax.rem(k, stages)
        plgpu.barrier_wait(loaded.at[slot])
        if prepare is not None:
            prepare(slot, k)
        issue(slot)
        plgpu.wgmma_wait(1)

        @pl.when((k >= 1) & (k - 1 + stages < steps))
        def _():
            fetch(k - 1 + stages, lax.rem(k - 1, stages))

    lax.fori_loop(0, steps, step, None)


def one_warpgroup_kernel(kernel, scratch, out_type, grid, grid_names, **params):
    """plgpu.kernel of a one-warpgroup CTA, in the Mosaic GPU interpreter under interpret mode
    (its effects hidden: they would block jax.checkpoint). params: plgpu.CompilerParams fields."""
    call = plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
                        compiler_params=plgpu.CompilerParams(**params), interpret=interpret_params())
    return without_effects(call, out_type) if interpret_enabled() else call


def zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, F32), plgpu.Layout.WGMMA)


def full_rows(n, value, axis):
    return plgpu.layout_cast(jnp.full((n,), value, F32), plgpu.Layout.WGMMA.reduce(axis))


def bcast(v, shape, dim):
    return lax.broadcast_in_dim(v, shape, [dim])



# ----------------------------------------------------------------------------- launch


CLUSTER_AXIS = kernel_axis("cluster")


def launch(name: str, kernel, scratch, barriers, out_type, schedule: Schedule, interpret: bool,
           row_reductions_only: bool = False, cluster: int = 1):
    """The plgpu.kernel of every attention kernel: `WGS` consumer warpgroups and a producer
    over the schedule's grid, running kernel(*inputs, *outputs, *scratch, *barriers) with every
    SMEM buffer and barrier allocated once for all warpgroups (a None scratch entry stays None:
    a buffer this call does not need). `name` is the kernel's name in profiles;
    `row_reductions_only`: see `compiler_params`; `cluster`: CTAs per cluster (axis CLUSTER_AXIS)."""

    def body(*refs):
        pl.run_scoped(lambda *s: kernel(*refs, *s), *scratch, *barriers, collective_axes=WG_AXIS)

    return plgpu.kernel(
        body,
        out_type=out_type,
        **schedule.grid,
        **(dict(cluster=(cluster,), cluster_names=(CLUSTER_AXIS,)) if cluster > 1 else {}),
        num_threads=WGS + 1,
        thread_name=WG_AXIS,
        compiler_params=compiler_params(row_reductions_only),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )

