"""ragged_dot / ragged_dot_transposed: every runnable backend against the XLA reference and
jax.lax.ragged_dot, forward and gradients.

On CPU this runs the XLA backends, and with FORGEAX_INTERPRET=1 the Mosaic GPU and TPU kernels in
their interpreters (the Triton interpreter in its own target, ragged_dot_triton_interpret_test.py,
with TRITON_INTERPRET=1); on a GPU the real kernels: `pytest tests/ragged_dot_test.py` against the
installed wheel. pallas_gpu takes bf16/f16 with K and N multiples of 64 (it refuses the other
cases, which then skip): the ALIGNED cases are its suite.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops
from forgeax.kernels.common.ragged_dot import RaggedDotSpec, row_tiles
from forgeax.kernels.xla import ragged_dot as reference

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# The reference itself ("xla") is checked once (test_reference_matches_jax_lax); the suites
# compare the other backends with it.
BACKENDS = [b for b in conformance.runnable_backends("ragged_dot") if b != "xla"]
# Interpreters pay per program: tiny shapes there; the XLA backends also take the wide K / N.
_INTERPRETED = interface.current_platform() == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _interpreted(backend: str) -> bool:
    return interface.current_platform() == "cpu" and backend in ("triton", "pallas_tpu", "pallas_gpu")


_ON_GPU = jax.default_backend() == "gpu"


def _reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
    out = jnp.dtype(preferred_element_type or lhs.dtype).name
    return reference.ragged_dot(lhs, rhs, group_sizes, spec=RaggedDotSpec(out_dtype=out))


def _reference_t(lhs, dout, group_sizes, *, preferred_element_type=None):
    out = jnp.dtype(preferred_element_type or lhs.dtype).name
    return reference.ragged_dot_transposed(lhs, dout, group_sizes, spec=RaggedDotSpec(out_dtype=out))


def _sizes(kind: str, g: int, m: int, seed: int) -> np.ndarray:
    """Group sizes of a kind: random (with zeros), one group holding every row, or summing to
    less than M (tail rows give 0)."""
    rng = np.random.default_rng(seed)
    if kind == "one":
        sizes = np.zeros(g, np.int32)
        sizes[rng.integers(g)] = m
        return sizes
    total = m if kind == "random" else max(1, (2 * m) // 3)
    cuts = np.sort(rng.integers(0, total + 1, g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    if g > 2:
        sizes[rng.integers(g)] += sizes[0]  # at least one empty group
        sizes[0] = 0
    return sizes


def _case(m, k, n, g, kind, dtype, *, seed=0, preferred=None):
    kl, kr = jax.random.split(jax.random.key(seed))
    lhs = conformance.random_array(kl, (m, k), dtype)
    rhs = conformance.random_array(kr, (g, k, n), dtype, scale=k ** -0.5)
    sizes = jnp.asarray(_sizes(kind, g, m, seed))
    kwargs = {} if preferred is None else {"preferred_element_type": preferred}
    return conformance.Case(f"ragged_dot(M={m}, K={k}, N={n}, G={g}, {kind})", ops.ragged_dot, _reference,
                            (lhs, rhs, sizes), kwargs, (0, 1), output_dtype=preferred)


# (M, K, N, G): G in {1, 8, 64, 128}; M off every tile; K / N odd.
SMALL = [(37, 24, 40, 1), (45, 20, 33, 8), (70, 16, 24, 64), (50, 16, 16, 128)]
KINDS = ["random", "one", "partial"]


@pytest.mark.parametrize("dtype,kind", [("f32", k) for k in KINDS] + [("bf16", "random")], ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_dot_matches_reference(backend, shape, kind, dtype):
    if _interpreted(backend) and (shape[3] >= 64 and kind != "random" or dtype == "bf16" and shape[3] != 8):
        pytest.skip("interpreter time: the wide-G shapes run once, bf16 at G = 8")
    seed = hash((shape, kind, dtype)) % 1000
    conformance.assert_conforms(_case(*shape, kind, DTYPES[dtype], seed=seed), backend)


@pytest.mark.parametrize("kn", [(128, 1000), (1000, 4096), (4096, 128)], ids=str)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.startswith("xla")] if not _INTERPRETED else [])
def test_wide_k_and_n_match_reference(backend, kn):
    k, n = kn
    conformance.assert_conforms(_case(40, k, n, 8, "random", jnp.float32, seed=k + n), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preferred_element_type_f32_from_bf16(backend):
    case = _case(33, 24, 40, 8, "partial", jnp.bfloat16, seed=3, preferred=jnp.float32)
    out, _ = conformance.assert_conforms(case, backend)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_jax_lax_ragged_dot(backend, dtype):
    case = _case(45, 20, 33, 8, "partial", DTYPES[dtype], seed=5)
    lhs, rhs, sizes = case.args
    try:
        out = jax.jit(lambda *a: ops.ragged_dot(*a, backend=backend))(lhs, rhs, sizes)
    except interface.UnsupportedError as e:
        pytest.skip(f"{backend} refuses: {e}")
    expect = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                                precision=jax.lax.Precision.HIGHEST)
    assert conformance.relative_error(out, expect) < conformance.TOLERANCE[jnp.dtype(DTYPES[dtype])]
    tail = int(np.sum(np.asarray(sizes)))
    assert tail < lhs.shape[0] and np.all(np.asarray(out[tail:]) == 0), "rows past the sum must be 0"


def _case_t(m, k, n, g, kind, dtype, *, seed=0):
    kl, kd = jax.random.split(jax.random.key(seed))
    lhs = conformance.random_array(kl, (m, k), dtype)
    dout = conformance.random_array(kd, (m, n), dtype)
    sizes = jnp.asarray(_sizes(kind, g, m, seed))
    return conformance.Case(f"ragged_dot_transposed(M={m}, K={k}, N={n}, G={g}, {kind})", ops.ragged_dot_transposed,
                            _reference_t, (lhs, dout, sizes), {}, (0, 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(45, 20, 33, 8), (50, 16, 16, 64)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_dot_transposed_matches_reference(backend, shape, kind):
    if _interpreted(backend) and shape[3] >= 64 and kind != "random":
        pytest.skip("interpreter time: the wide-G shape runs once")
    conformance.assert_conforms(_case_t(*shape, kind, jnp.float32, seed=hash((shape, kind)) % 1000), backend)


# (M, K, N, G, kind, dtype, preferred_element_type): K and N multiples of 64 (the wgmma kernel's
# tiles), M off every block, empty groups, a shared block per boundary, tail rows, f16 and an f32
# output from bf16 (moe_mlp's gate/up products). On a GPU, wider shapes and every group layout.
ALIGNED = [(150, 192, 64, 5, "random", "bf16", None), (101, 64, 128, 6, "partial", "f16", "f32")]
if _ON_GPU:
    ALIGNED += [(37, 64, 64, 1, "random", "bf16", None), (1000, 256, 384, 8, "one", "bf16", None),
                (4099, 512, 256, 64, "random", "bf16", "f32"), (3000, 192, 320, 128, "partial", "f16", None),
                (2048, 1024, 1024, 8, "random", "bf16", None)]
_16BIT = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}


def _aligned_backends():
    # On CPU only the interpreted Mosaic GPU kernel needs these (the others run the SMALL shapes).
    return BACKENDS if _ON_GPU else [b for b in BACKENDS if b == "pallas_gpu"]


@pytest.mark.parametrize("case", ALIGNED, ids=str)
@pytest.mark.parametrize("backend", _aligned_backends())
def test_aligned_matches_reference(backend, case):
    m, k, n, g, kind, dtype, preferred = case
    preferred = None if preferred is None else _16BIT[preferred]
    rd = _case(m, k, n, g, kind, _16BIT[dtype], seed=m + g, preferred=preferred)
    out, _ = conformance.assert_conforms(rd, backend)
    sizes = np.asarray(rd.args[2])
    tail = int(np.sum(sizes))
    assert np.all(np.asarray(out[tail:]) == 0), "rows past the sum must be 0"
    if g > 1 and np.count_nonzero(sizes) > 1 and backend == "pallas_gpu":
        bm = interface.OPS["ragged_dot"].implementation(backend).heuristic_config(*rd.args, spec=RaggedDotSpec(out_dtype="float32")).block_m
        assert np.any(np.cumsum(sizes)[:-1] % bm), "no block shared by two groups: the masked path is untested"


@pytest.mark.parametrize("case", ALIGNED[:1] + ALIGNED[3:5], ids=str)
@pytest.mark.parametrize("backend", _aligned_backends())
def test_aligned_transposed_matches_reference(backend, case):
    m, k, n, g, kind, dtype, _ = case
    conformance.assert_conforms(_case_t(m, k, n, g, kind, _16BIT[dtype], seed=m + k), backend)


@pytest.mark.skipif(_INTERPRETED, reason="the reference runs in the XLA target")
def test_reference_matches_jax_lax():
    # The reference (a loop of masked dense products) against XLA's own ragged_dot, forward and
    # gradients, wide K and N included.
    for m, k, n, g, kind in ((45, 20, 33, 8, "partial"), (40, 1000, 4096, 8, "one"), (50, 16, 16, 128, "random")):
        case = _case(m, k, n, g, kind, jnp.float32, seed=m + k)
        lhs, rhs, sizes = case.args
        ct = conformance.random_array(jax.random.key(1), (m, n), jnp.float32)
        lax_fn = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
        ref_fn = lambda a, b: _reference(a, b, sizes)  # noqa: E731
        out, pull = jax.vjp(jax.jit(ref_fn), lhs, rhs)
        expect, pull_lax = jax.vjp(lax_fn, lhs, rhs)
        assert conformance.relative_error(out, expect) < 1e-6
        for got, want in zip(pull(ct), pull_lax(ct)):
            assert conformance.relative_error(got, want) < 1e-6


def test_transposed_is_the_rhs_gradient():
    case = _case(45, 20, 33, 8, "partial", jnp.float32, seed=9)
    lhs, rhs, sizes = case.args
    dout = conformance.random_array(jax.random.key(4), (45, 33), jnp.float32)
    _, pullback = jax.vjp(lambda r: jax.lax.ragged_dot(lhs, r, sizes, precision=jax.lax.Precision.HIGHEST), rhs)
    (drhs,) = pullback(dout)
    for backend in conformance.runnable_backends("ragged_dot_transposed"):
        try:
            got = ops.ragged_dot_transposed(lhs, dout, sizes, backend=backend)
        except interface.UnsupportedError:
            continue  # pallas_gpu: 16-bit only (its transposed kernel: test_aligned_transposed_matches_reference)
        assert conformance.relative_error(got, drhs) < 1e-5, backend


def test_tile_table_covers_every_row_once():
    sizes = jnp.asarray([0, 5, 0, 17, 3], jnp.int32)
    group, row0, row1, count = (np.asarray(a) for a in row_tiles(sizes, 40, 8))
    covered = np.zeros(40, int)
    for t in range(int(count[0])):
        assert row1[t] - row0[t] <= 8 and row1[t] > row0[t]
        covered[row0[t]:row1[t]] += 1
        expect = np.searchsorted(np.cumsum(sizes), row0[t], side="right")
        assert group[t] == min(expect, 5)
    assert np.all(covered == 1)
    assert set(group[:int(count[0])]) == {1, 3, 4, 5}  # no tiles for empty groups; 5: the zero tail


def test_block_items_cover_every_row_once():
    # The Mosaic GPU forward's schedule: each group visits the aligned blocks its rows overlap.
    from forgeax.kernels.pallas.gpu.ragged_dot import block_items  # noqa: PLC0415 - imports Mosaic GPU

    sizes = jnp.asarray([0, 5, 0, 17, 3, 8], jnp.int32)  # sum 33 of M = 40: tail rows [33, 40)
    items, blocks = (np.asarray(a) for a in block_items(sizes, 40, 8))
    ends = np.cumsum(np.asarray(sizes))
    covered = np.zeros(40, int)
    for b in range(5):
        first, count = blocks[:, b]
        assert count >= 1
        for it in range(first, first + count):
            grp, blk, lo, hi = items[:, it]
            assert blk == b and b * 8 <= lo < hi <= b * 8 + 8
            expect = np.searchsorted(ends, lo, side="right")
            assert grp == min(expect, 6) and (grp == 6 or hi <= ends[grp])
            covered[lo:hi] += 1
    assert np.all(covered == 1)
    visits = int(blocks[1].sum())
    assert not {0, 2} & set(items[0, :visits].tolist())  # no visit by an empty group
    assert blocks[1].tolist() == [2, 1, 2, 2, 2]  # groups 1|3, 3, 3|4, 4|5, 5|tail


def test_bad_inputs_name_the_argument():
    lhs = jnp.ones((8, 4), jnp.float32)
    rhs = jnp.ones((3, 4, 5), jnp.float32)
    sizes = jnp.asarray([2, 3, 3], jnp.int32)
    with pytest.raises(ValueError, match="group_sizes"):
        ops.ragged_dot(lhs, rhs, sizes[:2])
    with pytest.raises(TypeError, match="group_sizes"):
        ops.ragged_dot(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="group_sizes"):
        ops.ragged_dot(lhs, rhs, sizes[None])
    with pytest.raises(ValueError, match="lhs"):
        ops.ragged_dot(lhs[None], rhs, sizes)
    with pytest.raises(ValueError, match="rhs"):
        ops.ragged_dot(lhs, rhs[0], sizes)
    with pytest.raises(ValueError, match="rhs"):
        ops.ragged_dot(lhs, jnp.ones((3, 6, 5), jnp.float32), sizes)
    with pytest.raises(TypeError, match="rhs"):
        ops.ragged_dot(lhs, rhs.astype(jnp.bfloat16), sizes)
    with pytest.raises(TypeError, match="preferred_element_type"):
        ops.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="dout"):
        ops.ragged_dot_transposed(lhs, jnp.ones((7, 5), jnp.float32), sizes)
    with pytest.raises(TypeError, match="group_sizes"):
        ops.ragged_dot_transposed(lhs, jnp.ones((8, 5), jnp.float32), sizes.astype(jnp.int64 if jax.config.x64_enabled else jnp.int16))
