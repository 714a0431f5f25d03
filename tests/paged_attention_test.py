"""paged_attention / decode_attention: every runnable backend against the XLA reference, and the
reference against ops.attention (the semantics they share).

On CPU this runs under FORGEAX_INTERPRET=1 (the Mosaic TPU interpreter; Triton's interpreter in
paged_attention_triton_interpret_test.py); on a GPU it runs the real kernels:
`pytest tests/paged_attention_test.py`. The ops are forward only, so no gradients are compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conformance
from forgeax import core as interface
from forgeax import ops

PAGED_BACKENDS = conformance.runnable_backends("paged_attention")
DECODE_BACKENDS = conformance.runnable_backends("decode_attention")
ON_GPU = interface.current_platform() == "gpu"

# name: (B, N, KV, H, page, lengths, dtype, options). Lengths include 0 and 1, and lengths that
# are not multiples of the page; groups N/KV of 4, 1 and 8; head dims 32, 64 and 48 (not a power of two).
CASES = {
    "gqa4_f32": (3, 8, 2, 32, 16, (0, 1, 37), jnp.float32, {}),
    "mha_bf16_window": (2, 4, 4, 64, 16, (16, 50), jnp.bfloat16, {"window": (20, 0)}),
    "mqa8_softcap_f16": (2, 8, 1, 32, 16, (33, 5), jnp.float16, {"logit_soft_cap": 3.0, "scale": 0.3}),
    "page64_window_cap": (2, 4, 2, 48, 64, (65, 130), jnp.float32, {"window": (70, None), "logit_soft_cap": 5.0}),
}
if ON_GPU:  # the full matrix where kernels run natively
    CASES.update({
        "long_gqa8_bf16": (4, 32, 4, 128, 16, (4097, 1, 0, 3000), jnp.bfloat16, {}),
        "long_page64_bf16": (3, 16, 2, 128, 64, (4097, 129, 2048), jnp.bfloat16, {"window": (1000, 0)}),
        "gqa4_h64_f16_cap": (5, 8, 2, 64, 16, (1, 17, 4000, 0, 333), jnp.float16, {"logit_soft_cap": 30.0}),
    })


def _paged_inputs(case: str, seed: int = 0, *, spare_pages: int = 3):
    """q, k_pages, v_pages, lengths, a shuffled page table (unused entries -1), and the contiguous
    cache [B, max_pages * page, KV, H] the pages hold."""
    B, N, KV, H, page, lengths, dtype, _ = CASES[case]
    max_pages = -(-max(lengths) // page) + 1
    num_pages = B * max_pages + spare_pages
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    q = conformance.random_array(kq, (B, N, H), dtype)
    k = conformance.random_array(kk, (B, max_pages * page, KV, H), dtype)
    v = conformance.random_array(kv, (B, max_pages * page, KV, H), dtype)
    perm = np.asarray(jax.random.permutation(kp, num_pages))[: B * max_pages].reshape(B, max_pages)
    k_pages = jnp.zeros((num_pages, page, KV, H), dtype).at[perm.reshape(-1)].set(k.reshape(-1, page, KV, H))
    v_pages = jnp.zeros((num_pages, page, KV, H), dtype).at[perm.reshape(-1)].set(v.reshape(-1, page, KV, H))
    lens = np.asarray(lengths, np.int32)
    used = np.arange(max_pages)[None, :] < -(-lens // page)[:, None]
    table = np.where(used, perm, -1).astype(np.int32)  # entries a request never reads hold -1
    return q, k_pages, v_pages, jnp.asarray(lens), jnp.asarray(table), k, v


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_matches_reference(case, backend):
    q, kp, vp, lens, table, _, _ = _paged_inputs(case)
    options = CASES[case][-1]
    conformance.assert_conforms(conformance.Case(
        name=f"paged_{case}",
        public=ops.paged_attention,
        reference=lambda *a, **kw: ops.paged_attention(*a, backend="xla", **kw),
        args=(q, kp, vp, lens, table), kwargs=options, diff_argnums=()), backend)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("case,num_splits", [("gqa4_f32", None), ("mqa8_softcap_f16", 3), ("page64_window_cap", 1)])
def test_decode_matches_reference(case, num_splits, backend):
    q, _, _, lens, _, k, v = _paged_inputs(case, seed=1)
    k, v = k[:, :-3], v[:, :-3]  # S not a multiple of any block
    options = dict(CASES[case][-1], num_splits=num_splits)
    conformance.assert_conforms(conformance.Case(
        name=f"decode_{case}",
        public=ops.decode_attention,
        reference=lambda *a, **kw: ops.decode_attention(*a, backend="xla", **kw),
        args=(q, k, v, lens), kwargs=options, diff_argnums=()), backend)


@pytest.mark.parametrize("backend", sorted(set(PAGED_BACKENDS) & set(DECODE_BACKENDS)))
def test_paged_equals_contiguous_and_lse(backend):
    """The paged and contiguous forms on the same keys agree (out and lse); length 0 gives 0, -inf."""
    q, kp, vp, lens, table, k, v = _paged_inputs("gqa4_f32", seed=2)
    out_p, lse_p = ops.paged_attention(q, kp, vp, lens, table, return_lse=True, backend=backend)
    out_c, lse_c = ops.decode_attention(q, k, v, lens, return_lse=True, backend=backend)
    _, ref_lse = ops.paged_attention(q, kp, vp, lens, table, return_lse=True, backend="xla")
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out_c), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_c), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(ref_lse), atol=2e-5)
    assert np.all(np.asarray(out_p)[0] == 0) and np.all(np.isneginf(np.asarray(lse_p)[0]))


@pytest.mark.parametrize("options", [{}, {"window": (4, 0), "logit_soft_cap": 2.0}, {"window": (0, None)}])
def test_reference_is_ops_attention_at_the_last_key(options):
    """The decode reference is ops.attention with T = 1 over each request's keys, causal."""
    q, kp, vp, lens, table, k, v = _paged_inputs("gqa4_f32", seed=3)
    out, lse = ops.paged_attention(q, kp, vp, lens, table, return_lse=True, backend="xla", **options)
    for b, L in enumerate(np.asarray(lens)):
        if L == 0:
            continue
        want, want_lse = ops.attention(q[b:b + 1, None], k[b:b + 1, :L], v[b:b + 1, :L], causal=True,
                                       return_lse=True, backend="xla", **options)
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(want[0, 0]), atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[b]), np.asarray(want_lse[0, 0]), atol=1e-5)


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_jit_does_not_retrace_for_new_lengths_or_tables(backend):
    q, kp, vp, lens, table, _, _ = _paged_inputs("gqa4_f32", seed=4)
    traces = []

    @jax.jit
    def step(lengths, page_table):
        traces.append(1)
        return ops.paged_attention(q, kp, vp, lengths, page_table, backend=backend)

    first = step(lens, table)
    lens2 = jnp.asarray([5, 17, 1], jnp.int32)
    table2 = jnp.maximum(table, 0)[::-1]  # other (valid) pages
    second = step(lens2, table2)
    assert len(traces) == 1
    want = ops.paged_attention(q, kp, vp, lens2, table2, backend="xla")
    np.testing.assert_allclose(np.asarray(second), np.asarray(want), atol=2e-5)
    assert not np.allclose(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decode_jit_does_not_retrace_for_new_lengths(backend):
    q, _, _, lens, _, k, v = _paged_inputs("gqa4_f32", seed=8)
    traces = []

    @jax.jit
    def step(lengths):
        traces.append(1)
        return ops.decode_attention(q, k, v, lengths, backend=backend)

    step(lens)
    lens2 = jnp.asarray([9, 0, 40], jnp.int32)
    got = step(lens2)
    assert len(traces) == 1
    np.testing.assert_allclose(np.asarray(got), np.asarray(ops.decode_attention(q, k, v, lens2, backend="xla")), atol=2e-5)


@pytest.mark.parametrize("backend", sorted(set(PAGED_BACKENDS) & set(DECODE_BACKENDS)))
def test_vmap_over_requests_and_caches(backend):
    """vmap over a second batch axis: of the requests over one shared page pool, and of caches."""
    q, kp, vp, lens, table, k, v = _paged_inputs("gqa4_f32", seed=9)
    qs = jnp.stack([q, q * 0.5])
    lens_s = jnp.stack([lens, jnp.asarray([3, 0, 20], jnp.int32)])
    tables = jnp.stack([table, jnp.maximum(table, 0)[::-1]])
    got = jax.jit(jax.vmap(lambda q, l, t: ops.paged_attention(q, kp, vp, l, t, backend=backend)))(qs, lens_s, tables)
    want = [ops.paged_attention(qs[i], kp, vp, lens_s[i], tables[i], backend="xla") for i in range(2)]
    np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=2e-5)
    ks = jnp.stack([k, -k])
    got = jax.jit(jax.vmap(lambda k, q, l: ops.decode_attention(q, k, v, l, backend=backend)))(ks, qs, lens_s)
    want = [ops.decode_attention(qs[i], ks[i], v, lens_s[i], backend="xla") for i in range(2)]
    np.testing.assert_allclose(np.asarray(got), np.stack(want), atol=2e-5)


def test_traced_out_of_range_page_ids_are_clamped():
    q, kp, vp, lens, table, _, _ = _paged_inputs("gqa4_f32", seed=5)
    bad = table.at[2, 0].set(10_000).at[2, 1].set(-7)
    got = jax.jit(lambda t: ops.paged_attention(q, kp, vp, lens, t))(bad)
    want = ops.paged_attention(q, kp, vp, lens, jnp.clip(bad, 0, kp.shape[0] - 1), backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_bad_inputs_name_the_argument():
    q, kp, vp, lens, table, k, v = _paged_inputs("gqa4_f32", seed=6)
    P = kp.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[2, 1\]"):
        ops.paged_attention(q, kp, vp, lens, table.at[2, 1].set(P))
    with pytest.raises(ValueError, match="lengths"):
        ops.paged_attention(q, kp, vp, lens.at[1].set(10_000), table)
    with pytest.raises(ValueError, match="page_table"):
        ops.paged_attention(q, kp, vp, lens, table[:2])
    with pytest.raises(TypeError, match="page_table"):
        ops.paged_attention(q, kp, vp, lens, table.astype(jnp.float32))
    with pytest.raises(TypeError, match="k_pages"):
        ops.paged_attention(q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16), lens, table)
    with pytest.raises(ValueError, match="v_pages"):
        ops.paged_attention(q, kp, vp[:, :8], lens, table)
    with pytest.raises(ValueError, match="k_pages"):
        ops.paged_attention(q[..., :16], kp, vp, lens, table)
    with pytest.raises(ValueError, match="kv heads"):
        ops.paged_attention(q[:, :7], kp, vp, lens, table)
    with pytest.raises(ValueError, match="q"):
        ops.paged_attention(q[:, None], kp, vp, lens, table)
    with pytest.raises(ValueError, match="lengths"):
        ops.decode_attention(q, k, v, lens.at[0].set(k.shape[1] + 1))
    with pytest.raises(ValueError, match="num_splits"):
        ops.decode_attention(q, k, v, lens, num_splits=0)
    with pytest.raises(ValueError, match="window"):
        ops.paged_attention(q, kp, vp, lens, table, window=(-1, 0))


def test_gradients_raise_a_clear_error():
    q, kp, vp, lens, table, k, v = _paged_inputs("gqa4_f32", seed=7)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda q: ops.paged_attention(q, kp, vp, lens, table).sum())(q)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda k: ops.decode_attention(q, k, v, lens).sum())(k)
