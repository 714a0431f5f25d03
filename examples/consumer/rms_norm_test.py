"""A consumer's test: forgeax.ops.rms_norm against a NumPy computation."""

import jax
import jax.numpy as jnp
import numpy as np

import forgeax
from forgeax import ops


def _rms_norm_numpy(x, scale, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps) * scale


def test_rms_norm_matches_numpy_f32():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 7, 333)).astype(np.float32)
    scale = (1.0 + 0.1 * rng.standard_normal(333)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, s: ops.rms_norm(x, s, eps=1e-5))(jnp.asarray(x), jnp.asarray(scale)))
    ref = _rms_norm_numpy(x, scale, 1e-5)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


def test_import_name_is_forgeax():
    assert forgeax.ops is ops
    assert ops.__name__ == "forgeax.ops"
