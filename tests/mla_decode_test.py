"""mla_decode: every runnable backend against the XLA reference, the reference against the math
(ops.attention over k = concat(kv_latent, k_rope), v = kv_latent), paged == contiguous, bad input.

On CPU this runs under FORGEAX_INTERPRET=1 (the Mosaic TPU interpreter; Triton's interpreter in
mla_decode_triton_interpret_test.py) on small latents (L = 64, R = 16) plus one DeepSeek-sized
case (L = 512, R = 64) with few keys; on a GPU it runs the real kernels and a DeepSeek-V3-shaped
matrix as well: `pytest tests/mla_decode_test.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import ops
from forgeax.kernels.common import paged

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
BACKENDS = conformance.runnable_backends("mla_decode")
ON_GPU = jax.default_backend() == "gpu"
# Checks of the reference and of the argument checks run where the xla backend is collected (not
# again in the Triton interpreter's process).
reference_only = pytest.mark.skipif("xla" not in BACKENDS, reason="backend-independent: runs in mla_decode_test")

# (B, N, L, R, S, lengths, page_size or None, dtype). Lengths 0, 1, full, and not multiples of
# any block; N odd and not a multiple of a head tile.
CASES = [
    (3, 5, 64, 16, 37, (0, 1, 37), None, "f32"),
    (2, 16, 64, 16, 50, (33, 17), None, "bf16"),
    (3, 5, 64, 16, 45, (0, 20, 45), 16, "f32"),
    (2, 6, 64, 16, 40, (40, 9), 8, "bf16"),
    (1, 4, 512, 64, 20, (19,), None, "bf16"),
    (2, 3, 64, 16, 30, (30, 5), None, "f16"),
    (2, 20, 64, 16, 33, (7, 33), 16, "f32"),  # two Triton head tiles, the second partial
]
if ON_GPU:  # DeepSeek-V3's heads and latent, long contexts, both page sizes
    CASES += [
        (4, 128, 512, 64, 4097, (0, 1, 4097, 2050), None, "bf16"),
        (4, 128, 512, 64, 4097, (4097, 0, 1, 3000), 16, "bf16"),
        (3, 128, 512, 64, 8192, (8192, 777, 64), 64, "bf16"),
        (2, 16, 512, 64, 1000, (999, 513), 64, "f32"),
    ]


def _inputs(case, seed=0):
    """(q_latent, q_rope, kv_latent, k_rope, lengths, page_table): a paged case gets a pool with
    spare pages, its requests' pages shuffled through it, unused table entries -1. NumPy draws
    (fresh per seed): eager jax.random would compile a few ops per new shape."""
    B, N, L, R, S, lengths, page, dtype = case
    rng = np.random.default_rng(seed)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(DTYPES[dtype]))  # noqa: E731
    ql, qr = rand(B, N, L), rand(B, N, R)
    lens = jnp.asarray(lengths, jnp.int32)
    if page is None:
        return ql, qr, rand(B, S, L), rand(B, S, R), lens, None
    M = -(-S // page)
    P = B * M + 3
    table = rng.permutation(P)[: B * M].reshape(B, M).astype(np.int32)
    used = np.arange(M)[None, :] < ((np.asarray(lengths) + page - 1) // page)[:, None]
    return ql, qr, rand(P, page, L), rand(P, page, R), lens, jnp.asarray(np.where(used, table, -1))


def _public(ql, qr, kv, kr, lens, table, *, backend=None, **kwargs):
    return ops.mla_decode(ql, qr, kv, kr, lens, page_table=table, backend=backend, **kwargs)


def _reference(ql, qr, kv, kr, lens, table, **kwargs):
    return _public(ql, qr, kv, kr, lens, table, backend="xla", **kwargs)


def _id(case):
    B, N, L, R, S, lengths, page, dtype = case
    return f"B{B}N{N}L{L}R{R}S{S}{'p' + str(page) if page else 'c'}-{dtype}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, case):
    args = _inputs(case)
    kwargs = {"scale": 0.11} if case[0] == 2 else {}  # a given scale and the DeepSeek default
    conformance.assert_conforms(conformance.Case("mla_decode", _public, _reference, args, kwargs, diff_argnums=()), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_and_empty_requests(backend):
    args = _inputs(CASES[2], seed=3)
    out, lse = _public(*args, backend=backend, return_lse=True)
    ref_out, ref_lse = _reference(*(a.astype(jnp.float32) if a is not None and a.dtype == jnp.float32 else a for a in args), return_lse=True)
    assert lse.dtype == jnp.float32 and lse.shape == args[0].shape[:2]
    empty = np.asarray(args[4]) == 0
    assert np.all(np.asarray(lse)[empty] == -np.inf) and np.all(np.asarray(out)[empty] == 0)
    assert conformance.relative_error(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty]) < 1e-5
    assert conformance.relative_error(out, ref_out) < 1e-5


def _as_contiguous(kv_pages, table, S):
    return paged.gather_pages(kv_pages, table)[:, :S]


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_equals_contiguous(backend):
    ql, qr, kv, kr, lens, table = _inputs(CASES[2], seed=5)
    S = CASES[2][4]
    got = _public(ql, qr, kv, kr, lens, table, backend=backend)
    want = _public(ql, qr, _as_contiguous(kv, table, S), _as_contiguous(kr, table, S), lens, None, backend=backend)
    assert conformance.relative_error(got, want) < 1e-6


def _attention_layout(ql, qr, kv, kr, lens, scale, backend="xla"):
    """mla_decode as ops.attention: one query, one kv head, k = [latent, rope], v = latent."""
    q = jnp.concatenate([ql, qr], axis=-1)[:, None]
    k = jnp.concatenate([kv, kr], axis=-1)[:, :, None]
    mask = (jnp.arange(kv.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    return ops.attention(q, k, kv[:, :, None], scale=scale, mask=mask, backend=backend)[:, 0]


@reference_only
def test_reference_is_attention_over_the_concatenated_cache():
    ql, qr, kv, kr, lens, _ = _inputs(CASES[0], seed=7)
    scale = 192 ** -0.5
    out = jax.jit(lambda *a: _public(*a, None, backend="xla"))(ql, qr, kv, kr, lens)
    want = jax.jit(lambda *a: _attention_layout(*a, scale))(ql, qr, kv, kr, lens)
    assert conformance.relative_error(out, want) < 1e-6
    # The reference's gradient (plain autodiff) is attention's.
    ct = np.random.default_rng(9).standard_normal(out.shape, np.float32)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3)))  # noqa: E731
    grads = grad(lambda *a: _public(*a, lens, None, backend="xla"))(ql, qr, kv, kr)
    want_grads = grad(lambda *a: _attention_layout(*a, lens, scale))(ql, qr, kv, kr)
    for g, w in zip(grads, want_grads):
        assert np.isfinite(np.asarray(g)).all() and conformance.relative_error(g, w) < 1e-5


@reference_only
def test_reference_matches_float64_math():
    ql, qr, kv, kr, lens, _ = _inputs(CASES[0], seed=11)
    out = np.asarray(_public(ql, qr, kv, kr, lens, None, backend="xla", scale=0.2))
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    for b, n in ((1, 0), (2, 4)):
        z = 0.2 * (f(kv[b]) @ f(ql[b, n]) + f(kr[b]) @ f(qr[b, n]))[: int(lens[b])]
        p = np.exp(z - z.max())
        want = (p / p.sum()) @ f(kv[b])[: int(lens[b])]
        assert np.abs(out[b, n] - want).max() < 1e-5
    assert np.all(out[0] == 0)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "xla"])
def test_kernels_are_forward_only(backend):
    ql, qr, kv, kr, lens, _ = _inputs(CASES[0])
    with pytest.raises(NotImplementedError, match="forward-only.*backend='xla'"):
        jax.grad(lambda q: jnp.sum(_public(q, qr, kv, kr, lens, None, backend=backend)))(ql)


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton backend does not run here")
@pytest.mark.parametrize("splits,block_n", [(1, 16), (3, 32)])
def test_triton_splits_merge_to_the_reference(splits, block_n):
    from forgeax.kernels.triton.mla_decode import MlaDecodeTritonConfig  # noqa: PLC0415

    args = _inputs(CASES[2], seed=13)
    config = MlaDecodeTritonConfig(block_h=16, block_n=block_n, num_splits=splits)
    got = _public(*args, backend="triton", config=config)
    assert conformance.relative_error(got, _reference(*args)) < 1e-5


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton backend does not run here")
def test_triton_unpadded_dims_whole_blocks_and_tails():
    """L = 48, R = 8 (padded to 64 / 16 in the kernel), paged: runs of whole 16-key blocks (no
    key mask) and partial last blocks (masked), a run past a short request's end."""
    from forgeax.kernels.triton.mla_decode import MlaDecodeTritonConfig  # noqa: PLC0415

    args = _inputs((3, 5, 48, 8, 40, (40, 17, 32), 8, "f32"), seed=29)
    got = _public(*args, backend="triton", config=MlaDecodeTritonConfig(block_h=16, block_n=16, num_splits=2))
    assert conformance.relative_error(got, _reference(*args)) < 1e-5


@pytest.mark.skipif("pallas_tpu" not in BACKENDS, reason="the Mosaic TPU backend does not run here")
def test_pallas_tpu_head_tiles_and_key_blocks():
    from forgeax.kernels.pallas.tpu.mla_decode import MlaDecodeTpuConfig  # noqa: PLC0415

    case = (2, 32, 64, 16, 70, (70, 31), None, "f32")
    args = _inputs(case, seed=17)
    got = _public(*args, backend="pallas_tpu", config=MlaDecodeTpuConfig(block_h=16, block_n=32))
    assert conformance.relative_error(got, _reference(*args)) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged_case", [False, True], ids=["contiguous", "paged"])
def test_vmap_matches_a_loop(backend, paged_case):
    case = CASES[2] if paged_case else CASES[0]
    one, two = _inputs(case, seed=19), _inputs(case, seed=23)
    stacked = [None if a is None else jnp.stack([a, b]) for a, b in zip(one, two)]
    if paged_case:  # one shared page pool, two sets of requests over it
        stacked[2], stacked[3] = one[2], one[3]
        two = two[:2] + one[2:4] + two[4:]
    axes = tuple(None if (a is None or (paged_case and i in (2, 3))) else 0 for i, a in enumerate(stacked))
    got = jax.vmap(lambda *a: _public(*a, backend=backend), in_axes=axes)(*stacked)
    for i, args in enumerate((one, two)):
        assert conformance.relative_error(got[i], _public(*args, backend=backend)) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_lengths_do_not_recompile(backend):
    ql, qr, kv, kr, lens, table = _inputs(CASES[2])
    run = jax.jit(lambda *a: _public(*a, backend=backend))
    first = run(ql, qr, kv, kr, lens, table)
    second = run(ql, qr, kv, kr, jnp.asarray([3, 0, 44], jnp.int32), table)
    assert run._cache_size() == 1
    assert np.all(np.asarray(second)[1] == 0) and not np.array_equal(np.asarray(first), np.asarray(second))


def _bad(name):
    ql, qr, kv, kr, lens, table = _inputs(CASES[2])
    contiguous = _inputs(CASES[0])
    calls = {
        "q_latent": lambda: ops.mla_decode(ql[0], qr, kv, kr, lens, page_table=table),
        "q_rope": lambda: ops.mla_decode(ql, qr.astype(jnp.bfloat16), kv, kr, lens, page_table=table),
        "q_rope shape": lambda: ops.mla_decode(ql, qr[:, :2], kv, kr, lens, page_table=table),
        "kv_latent": lambda: ops.mla_decode(ql, qr, kv[..., :32], kr, lens, page_table=table),
        "kv_latent batch": lambda: ops.mla_decode(*contiguous[:2], contiguous[2][:2], contiguous[3][:2], contiguous[4]),
        "k_rope": lambda: ops.mla_decode(ql, qr, kv, kr[:, :4], lens, page_table=table),
        "lengths": lambda: ops.mla_decode(ql, qr, kv, kr, lens.astype(jnp.float32), page_table=table),
        "lengths shape": lambda: ops.mla_decode(ql, qr, kv, kr, lens[:2], page_table=table),
        "lengths range": lambda: ops.mla_decode(*contiguous[:4], jnp.asarray([0, 1, 38], jnp.int32)),
        "lengths pages": lambda: ops.mla_decode(ql, qr, kv, kr, jnp.asarray([0, 1, 49], jnp.int32), page_table=table),
        "page_table": lambda: ops.mla_decode(ql, qr, kv, kr, lens, page_table=table.at[2, 1].set(kv.shape[0])),
        "page_table shape": lambda: ops.mla_decode(ql, qr, kv, kr, lens, page_table=table[:2]),
        "scale": lambda: ops.mla_decode(ql, qr, kv, kr, lens, page_table=table, scale=-1.0),
        "return_lse": lambda: ops.mla_decode(ql, qr, kv, kr, lens, page_table=table, return_lse=1),
        "backend": lambda: ops.mla_decode(ql, qr, kv, kr, lens, page_table=table, backend="cudnn"),
    }
    return calls[name]


@reference_only
@pytest.mark.parametrize("name", ["q_latent", "q_rope", "q_rope shape", "kv_latent", "kv_latent batch", "k_rope", "lengths",
                                  "lengths shape", "lengths range", "lengths pages", "page_table", "page_table shape",
                                  "scale", "return_lse", "backend"])
def test_bad_input_errors_name_the_argument(name):
    with pytest.raises((ValueError, TypeError), match=f"^{name.split()[0]}"):
        _bad(name)()


@reference_only
def test_traced_page_ids_out_of_range_are_clamped():
    ql, qr, kv, kr, lens, table = _inputs(CASES[2])
    wild = table.at[2, 1].set(10_000).at[1, 0].set(-7)
    out = jax.jit(lambda t: ops.mla_decode(ql, qr, kv, kr, lens, page_table=t, backend="xla"))(wild)
    clamped = ops.mla_decode(ql, qr, kv, kr, lens, page_table=jnp.clip(wild, 0, kv.shape[0] - 1), backend="xla")
    assert np.isfinite(np.asarray(out)).all() and np.array_equal(np.asarray(out), np.asarray(clamped))
