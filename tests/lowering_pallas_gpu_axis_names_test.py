"""Every Pallas Mosaic GPU kernel names its grid / cluster / thread axes privately.

Mosaic GPU (jax 0.11.2, `_axis_index_rule`) resolves `lax.axis_index(name)` against the
enclosing JAX mesh's axis names before the kernel's own grid / cluster / warpgroup names. A
kernel whose grid axis is called like a user's mesh axis ("v", "batch", "heads", "t", ...) and
that runs inside shard_map (or under such a mesh) reads the device's mesh position instead of
its block index: silently wrong results (linear_cross_entropy gave NaN losses on 2 GPUs under a
mesh axis "v"). The CPU interpreter resolves the grid first and cannot show it, so this traces
each pallas_gpu op's forward + backward with every candidate config (kernels compiled, not
interpreted) and checks every axis name a kernel declares (grid_names, cluster_names,
thread_name) or reads (axis_index, collective_axes) starts with the private prefix
(`forgeax.kernels.pallas.gpu.kernel_axis`). A source scan catches kernels without a case here.

Run: JAX_PLATFORMS=cpu pytest tests/lowering_pallas_gpu_axis_names_test.py
"""

from __future__ import annotations

import ast
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import pytest

from forgeax.core.runtime import interpret_mode
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.common.gated_mlp import GatedMLPSpec
from forgeax.kernels.common.losses import LossSpec
from forgeax.kernels.common.newton_schulz import NewtonSchulzSpec
from forgeax.kernels.common.ragged_dot import RaggedDotSpec
from forgeax.kernels.pallas.gpu import AXIS_PREFIX

KERNELS_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "pallas" / "gpu"
# Axis names users give meshes: none may ever be a kernel axis.
MESH_AXES = {"data", "model", "batch", "heads", "seq", "v", "t", "b", "m", "rows", "x", "y", "dp", "tp", "sp",
             "ring", "fsdp", "expert", "wg", "cta", "ctas"}
_MESH_FIELDS = ("grid_names", "cluster_names", "thread_name")
_NAME_PARAMS = ("axis_name", "axis_names", "collective_axes")


def _names(value):
    if value is None:
        return set()
    return {value} if isinstance(value, str) else set(value)


def kernel_axis_names(jaxpr, inside=False) -> set:
    """The axis names Mosaic GPU kernels anywhere in `jaxpr` declare (their plgpu meshes' grid,
    cluster and thread names) or use inside their bodies (axis_index, collective_axes)."""
    found = set()
    for eqn in jaxpr.eqns:
        params = eqn.params
        for mesh in (*params.get("meshes", ()), params.get("mesh")):  # mpmd_map / core_map
            for field in _MESH_FIELDS:
                found |= _names(getattr(mesh, field, None))
        if inside:
            for key in _NAME_PARAMS:
                found |= _names(params.get(key))
        inner = inside or eqn.primitive.name in ("mpmd_map", "pallas_call", "core_map")
        for param in params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found |= kernel_axis_names(sub, inner)
    return found


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _cases():
    """name -> (implementation, args, kwargs, indices of the differentiated args, configs beyond
    the candidates). Shapes large enough for the persistent grids (more tiles than the 132 SMs
    assumed off the GPU)."""
    from forgeax.kernels.pallas.gpu import attention, gated_mlp, linear_cross_entropy, newton_schulz, norms, ragged_dot

    x, scale, offset = _sds((300, 256)), _sds((256,), jnp.float32), _sds((256,), jnp.float32)
    q = _sds((1, 2048, 16, 128))
    lhs, rhs, sizes = _sds((300, 128)), _sds((5, 128, 192)), _sds((5,), jnp.int32)
    return {
        "rms_norm": (norms.RMS_NORM, (x, scale), {"eps": 1e-6}, (0, 1), ()),
        "layer_norm": (norms.LAYER_NORM, (x, scale, offset), {"eps": 1e-6}, (0, 1, 2), ()),
        "gated_mlp": (gated_mlp.GATED_MLP, (_sds((300, 128)), _sds((128, 192)), _sds((128, 192)), _sds((192, 64))),
                      {"spec": GatedMLPSpec()}, (0, 1, 2, 3), ()),
        "ragged_dot": (ragged_dot.RAGGED_DOT, (lhs, rhs, sizes), {"spec": RaggedDotSpec("bfloat16")}, (0, 1), ()),
        "ragged_dot_transposed": (ragged_dot.RAGGED_DOT_TRANSPOSED, (lhs, _sds((300, 192)), sizes),
                                  {"spec": RaggedDotSpec("float32")}, (), ()),
        "newton_schulz": (newton_schulz.NEWTON_SCHULZ, (_sds((2, 192, 320), jnp.float32),),
                          {"spec": NewtonSchulzSpec(steps=1)}, (), ()),
        "attention": (attention.ATTENTION, (q, q, q, None, None, None, None, None),
                      {"spec": AttentionSpec(causal=True, scale=0.125)}, (0, 1, 2), ()),
        "linear_cross_entropy": (linear_cross_entropy.LINEAR_CROSS_ENTROPY,
                                 (_sds((300, 64)), _sds((64, 4096)), _sds((300,), jnp.int32)),
                                 {"spec": LossSpec(label_smoothing=0.1)}, (0, 1),
                                 # two warpgroups (a thread axis) are no candidate yet
                                 (linear_cross_entropy.LinearCrossEntropyPallasGpuConfig(warpgroups=2, stages=3),)),
    }


CASES = sorted(_cases())


def _configs(impl, args, kwargs, extra):
    if impl.config_type is None:
        return [None]
    configs = list(impl.candidate_configs(*args, **kwargs)) if impl.candidate_configs else []
    configs += [impl.heuristic_config(*args, **kwargs), *extra]
    return list(dict.fromkeys(configs))


def _traced_names(impl, args, kwargs, diff, config) -> set:
    def fwd_bwd(*all_args):
        def call(*d):
            full = list(all_args)
            for i, a in zip(diff, d):
                full[i] = a
            return impl.call(full, kwargs, config)

        if not diff:
            return call()
        out, pullback = jax.vjp(call, *(all_args[i] for i in diff))
        return pullback(jax.tree.map(jnp.ones_like, out))

    return kernel_axis_names(jax.make_jaxpr(fwd_bwd)(*args).jaxpr)


@pytest.mark.parametrize("op", CASES)
def test_kernel_axis_names_are_private(op):
    impl, args, kwargs, diff, extra = _cases()[op]
    with interpret_mode(False):  # the compiled kernels' names, whatever the environment
        assert impl.supports(*args, **kwargs) is None
        for config in _configs(impl, args, kwargs, extra):
            names = _traced_names(impl, args, kwargs, diff, config)
            assert names, (op, config)  # the walk found the kernels
            public = sorted(n for n in names if not str(n).startswith(AXIS_PREFIX) or n in MESH_AXES)
            assert not public, f"{op} {config}: kernel axes {public} can collide with a mesh axis"


def _literal_axis_names(tree: ast.AST):
    """String literals handed straight to lax.axis_index or to a kernel's axis-name arguments."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        values = list(node.args[:1]) if func == "axis_index" else []
        values += [k.value for k in node.keywords if k.arg in ("grid_names", "cluster_names", "thread_name",
                                                              "collective_axes", "axis_name", "axis_names")]
        for value in values:
            for leaf in ast.walk(value):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                    yield node.lineno, leaf.value


def test_no_kernel_source_names_an_axis_literally():
    """Axis names come from `kernel_axis` constants, so a kernel added without a case above
    cannot bring back a public name."""
    literal = [f"{path.name}:{line} {name!r}" for path in sorted(KERNELS_DIR.glob("*.py"))
               for line, name in _literal_axis_names(ast.parse(path.read_text()))]
    assert not literal, literal
