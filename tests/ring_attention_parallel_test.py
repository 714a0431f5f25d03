"""Ring attention inside shard_map over 8 CPU devices equals ops.attention on the gathered
sequence, forward and gradients: causal and not, windows, segment ids, GQA, soft cap, both
layouts, and a length that the ring does not divide (padded with its own segment id)."""

from __future__ import annotations

import parallel_env  # first: XLA_FLAGS before jax starts

parallel_env.interpret_triton_on_cpu()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import forgeax
from forgeax import core as interface
from forgeax import ops

ON_GPU = parallel_env.skip_unless_devices(cpu=8, gpu=2)


def _mesh(n):
    if n > len(jax.devices()):
        pytest.skip(f"needs {n} devices, {len(jax.devices())} here")
    return jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def _inputs(B, T, N, K, H, seed, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, T, K, H), dtype)
    v = jax.random.normal(keys[2], (B, T, K, H), dtype)
    cot = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    return q, k, v, cot


def _ring_loss(mesh, layout, segments, backend="xla", **kwargs):
    seq = P(None, "sp")
    in_specs = (seq, seq, seq, seq) + ((seq, seq) if segments else ())

    def local(q, k, v, cot, *seg):
        out = ops.ring_attention(q, k, v, axis_name="sp", layout=layout,
                                  segment_ids=tuple(seg) if seg else None, backend=backend, **kwargs)
        return out, jax.lax.psum(jnp.sum(out.astype(jnp.float32) * cot), "sp")

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(seq, P())))


def _check(n, B, T, N, K, H, layout="contiguous", segments=None, seed=0, backend="xla", tol=2e-5, dtype=jnp.float32,
           **kwargs):
    mesh = _mesh(n)
    q, k, v, cot = _inputs(B, T, N, K, H, seed, dtype)
    seg_args = (segments, segments) if segments is not None else ()

    def reference(q, k, v):
        out = ops.attention(q, k, v, segment_ids=(segments, segments) if segments is not None else None,
                            backend="xla", **kwargs)
        return jnp.sum(out * cot), out

    (ref_loss, ref_out), ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    arrange = (lambda x: ops.to_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
    unarrange = (lambda x: ops.from_zigzag(x, n)) if layout == "zigzag" else (lambda x: x)
    fn = _ring_loss(mesh, layout, segments is not None, backend, **kwargs)
    args = [arrange(a) for a in (q, k, v, cot)] + [arrange(s) for s in seg_args]
    out, loss = fn(*args)
    grads = jax.grad(lambda q, k, v: fn(q, k, v, *args[3:])[1], argnums=(0, 1, 2))(*args[:3])
    np.testing.assert_allclose(unarrange(out), ref_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(loss, ref_loss, rtol=tol, atol=5 * tol)
    for got, want, name in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(unarrange(got), want, rtol=10 * tol, atol=10 * tol, err_msg=f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_equals_attention_on_the_gathered_sequence(causal, layout):
    _check(4, B=2, T=64, N=4, K=2, H=16, layout=layout, causal=causal, seed=1)


@pytest.mark.skipif(not ON_GPU, reason="the GPU kernels as the ring's local attention (interpreted on CPU elsewhere)")
@pytest.mark.parametrize("backend", ["triton", "pallas_gpu", "cudnn"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_with_the_gpu_kernels(backend, layout):
    # cudnn: named explicitly, a refusal would raise (no fallback), so its raw kernels ran.
    # bf16: what the Mosaic GPU kernels take (and what the ring carries in training).
    _check(min(4, len(jax.devices())), B=1, T=1024, N=4, K=2, H=64, layout=layout, causal=True, seed=5,
           backend=backend, tol=2e-2, dtype=jnp.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="the selection's GPU choices per block")
def test_ring_with_the_default_selection_per_block():
    # Causal GQA at head_dim 256 on a Hopper GPU: the diagonal block's forward runs pallas_gpu (rule
    # forward-gqa) and its backward cuDNN (the training priority), the unmasked blocks cuDNN: the
    # backward takes the out and lse another backend's forward made.
    n = min(4, len(jax.devices()))
    B, T, N, K, H = 1, 1024, 4, 2, 256
    _check(n, B=B, T=T, N=N, K=K, H=H, layout="zigzag", causal=True, seed=9, backend=None, tol=2e-2,
           dtype=jnp.bfloat16)
    q, kv = (jax.ShapeDtypeStruct((B, T, heads, H), jnp.bfloat16) for heads in (N, K))
    loss = _ring_loss(_mesh(n), "zigzag", False, None, causal=True)
    report = forgeax.explain(jax.grad(lambda q, k, v: loss(q, k, v, jnp.zeros((B, T, N, H), jnp.float32))[1],
                                      argnums=(0, 1, 2)), q, kv, kv)
    ran = ({d.backend for d in report.decisions} | {d.gradient_backend for d in report.decisions}) - {None}
    assert ran and ran <= {"cudnn", "pallas_gpu", "triton"}, report
    if interface.current_compute_capability().startswith("9."):  # the rules are measured on Hopper
        assert any(d.gradient_backend not in (None, d.backend) for d in report.decisions), report


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_runs_raw_kernels_with_the_global_statistics(layout, causal):
    # xla_chunked exposes its forward / backward (Implementation.kernels): the ring's backward is
    # then the kernel backward given the global out and lse, with no block forward recomputed.
    _check(4, B=1, T=64, N=4, K=2, H=16, layout=layout, causal=causal, seed=8, backend="xla_chunked",
           segments=jnp.asarray(np.repeat(np.arange(3), [10, 40, 14])[None], jnp.int32))


@pytest.mark.skipif(ON_GPU, reason="an interpreter check for CPU runs; on a GPU the kernels run natively above")
def test_ring_with_an_interpreted_kernel_backend(monkeypatch):
    # The kernels drop shard_map's varying-axes type; their custom_vjp restores it. A cast outside
    # it would turn into a psum of the cotangents (summed gradients) inside the causal switch.
    monkeypatch.setenv("FORGEAX_INTERPRET", "1")
    _check(2, B=1, T=128, N=2, K=1, H=32, causal=True, seed=6, backend="triton", tol=2e-2, dtype=jnp.bfloat16)


def test_ring_over_eight_devices_with_mqa_and_soft_cap():
    _check(8, B=1, T=64, N=4, K=1, H=8, causal=True, logit_soft_cap=5.0, seed=2)


@pytest.mark.parametrize("window", [(5, 0), (12, 3)])
def test_ring_with_a_window_by_global_position(window):
    _check(4, B=1, T=48, N=2, K=2, H=8, causal=window[1] == 0, window=window, seed=3)


def test_ring_with_segments_across_shard_boundaries():
    ids = jnp.asarray(np.repeat(np.arange(5), [7, 20, 3, 18, 16])[None].repeat(2, 0), jnp.int32)
    _check(4, B=2, T=64, N=2, K=1, H=8, causal=True, segments=ids, seed=4)


def test_a_length_the_ring_does_not_divide_runs_padded_with_its_own_segment():
    n, T = 4, 37
    q, k, v, cot = _inputs(1, T, 2, 2, 8, 5)
    ref = ops.attention(q, k, v, causal=True, backend="xla")
    padded = [ops.pad_to_ring(a, n)[0] for a in (q, k, v)]
    ids = ops.pad_to_ring(q, n)[1]
    seq = P(None, "sp")
    fn = jax.jit(jax.shard_map(lambda q, k, v, s: ops.ring_attention(q, k, v, axis_name="sp", causal=True, segment_ids=(s, s), backend="xla"),
                               mesh=_mesh(n), in_specs=(seq,) * 4, out_specs=seq))
    out = fn(*padded, ids)
    assert out.shape[1] == 40
    np.testing.assert_allclose(out[:, :T], ref, rtol=2e-5, atol=2e-5)


def test_zigzag_round_trip_and_bad_arguments():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(ops.from_zigzag(ops.to_zigzag(x, 4), 4), x)
    assert list(ops.to_zigzag(jnp.arange(8)[None], 2)[0]) == [0, 1, 6, 7, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2"):
        ops.to_zigzag(jnp.zeros((1, 10)), 4)
    q = jnp.zeros((1, 8, 2, 8))
    fn = lambda **kw: jax.shard_map(lambda q: ops.ring_attention(q, q, q, axis_name="sp", **kw), mesh=_mesh(2),  # noqa: E731
                                    in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
    with pytest.raises(ValueError, match="layout"):
        fn(layout="striped")


def test_the_ring_moves_kv_by_collective_permute_and_gathers_nothing():
    q, k, v, cot = _inputs(1, 64, 2, 2, 8, 6)
    fn = _ring_loss(_mesh(4), "contiguous", False, causal=True)
    text = fn.lower(q, k, v, cot).compile().as_text()
    assert "collective-permute" in text
    assert "all-gather" not in text and "all-to-all" not in text
    grad_text = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v, cot)[1], argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert "collective-permute" in grad_text and "all-gather" not in grad_text


def test_return_lse_is_the_gathered_sequence_lse():
    q, k, v, _ = _inputs(1, 32, 2, 1, 8, 7)
    _, ref_lse = ops.attention(q, k, v, causal=True, return_lse=True, backend="xla")
    seq = P(None, "sp")
    fn = jax.shard_map(lambda q, k, v: ops.ring_attention(q, k, v, axis_name="sp", causal=True, return_lse=True, backend="xla"),
                       mesh=_mesh(4), in_specs=(seq,) * 3, out_specs=(seq, seq))
    np.testing.assert_allclose(fn(q, k, v)[1], ref_lse, rtol=1e-5, atol=1e-5)
