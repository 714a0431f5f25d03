"""Attention's selection rules (ops/rules/attention.json) reproduce the routing they replaced.

Before the rules became data, `ops/attention.py` chose backends with two functions,
`_inference_order` and `_training_order` (if-trees, identical on every GPU). They are kept
below, verbatim in logic but for rules added since (marked), as the oracle: over a grid of
calls on an H100 and an H200 the rules must give the same ordered candidate lists (the
dispatcher then walks one list with the same
`supports(...)` checks, so equal lists mean equal choices). On a device no rule names, the rules
give the plain priority.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import pytest

from forgeax.core import OPS
from forgeax.kernels.common.attention import AttentionSpec
from forgeax.kernels.pallas.gpu import attention as pallas_gpu_attention

# ---------------------------------------------------------------- the replaced routing (oracle)
_HEAD_DIMS = (64, 96, 128, 192, 256)
_GQA_MAX_SCORES_BYTES = 4 << 30
_FLAT_FORWARD_HEAD_DIMS = (128,)


def _aligned(args):
    return all(n >= 128 and n % 8 == 0 for n in (args[0].shape[1], args[1].shape[1]))


def _legacy_inference_order(platform, args, kwargs):
    q, k, v = args[0], args[1], args[2]
    spec = kwargs["spec"]
    if platform == "gpu" and args[0].shape[3] not in _HEAD_DIMS:
        return ("cudnn", "triton")
    if platform != "gpu" or not spec.has_position_mask or not _aligned(args):
        return ()
    flat = q.shape[3] in _FLAT_FORWARD_HEAD_DIMS and v.shape[3] == q.shape[3]
    if q.shape[2] > k.shape[2] or spec.window_left is not None or flat:
        return ("pallas_gpu",)
    return ()


def _legacy_training_order(platform, args, kwargs):
    spec = kwargs["spec"]
    q, k, v = args[0], args[1], args[2]
    if platform != "gpu" or not spec.causal or spec.window_left is not None or v.shape[3] != q.shape[3]:
        return ()
    if not _aligned(args):
        return ()
    if q.shape[3] in (64, 96, 192):
        return ("pallas_gpu",)
    if q.shape[3] == 128:  # GQA (first rule) and, since 2026-11-27, MHA (causal-mha-head-dim-128)
        whole = lambda n: -(-n // 128) * 128  # noqa: E731
        nbytes = math.prod(q.shape[:-3]) * q.shape[-2] * whole(q.shape[-3]) * whole(k.shape[-3]) * 2
        if nbytes <= _GQA_MAX_SCORES_BYTES:
            return ("pallas_gpu",)
    return ()


def _legacy_lists(op, platform, args, kwargs):
    first = tuple(_legacy_training_order(platform, args, kwargs))
    training = first + op.priority(platform)
    prefer = tuple(_legacy_inference_order(platform, args, kwargs))
    inference = (prefer + training) if prefer else None
    return training, inference


def _rule_lists(op, platform, device_kind, args, kwargs):
    fired = op.selection.fired(platform, device_kind, lambda: op.features(args, kwargs))
    training = (fired["all"].prefer if "all" in fired else ()) + op.priority(platform)
    inference = (fired["forward_only"].prefer + training) if "forward_only" in fired else None
    return training, inference


# ---------------------------------------------------------------- the grid
def _calls():
    head_dims = (64, 80, 96, 128, 160, 192, 256)
    lengths = ((4096, 4096), (8192, 8192), (100, 100), (4001, 4001), (1000, 4096), (16384, 16384))
    heads = ((32, 32), (32, 8), (16, 1))
    masks = (dict(causal=False), dict(causal=True), dict(causal=True, window_left=1024, window_right=0),
             dict(causal=False, window_left=256, window_right=256))
    for H, v_same, (T, S), (N, K), mask, B in itertools.product(head_dims, (True, False), lengths, heads, masks, (1, 4)):
        Hv = H if v_same else 128
        q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
        v = jax.ShapeDtypeStruct((B, S, K, Hv), jnp.bfloat16)
        yield (q, k, v, None, None, None, None, None), {"spec": AttentionSpec(**mask)}


CALLS = list(_calls())


@pytest.mark.parametrize("device_kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_rules_reproduce_the_replaced_routing_on_hopper(device_kind):
    op = OPS["attention"]
    differences = []
    for args, kwargs in CALLS:
        old = _legacy_lists(op, "gpu", args, kwargs)
        new = _rule_lists(op, "gpu", device_kind, args, kwargs)
        if old != new:
            differences.append((args[0].shape, args[1].shape, args[2].shape, kwargs["spec"], old, new))
    assert len(CALLS) == 2016
    assert not differences, f"{len(differences)} calls differ, e.g. {differences[:3]}"


def test_the_grid_exercises_every_rule():
    op = OPS["attention"]
    fired_ids = set()
    for args, kwargs in CALLS:
        fired = op.selection.fired("gpu", "NVIDIA H200", lambda: op.features(args, kwargs))
        fired_ids |= {rule.id for rule in fired.values()}
    assert fired_ids == {rule.id for rule in op.selection.rules}


def test_unmeasured_devices_and_other_platforms_get_the_plain_priority():
    op = OPS["attention"]
    for args, kwargs in CALLS[:200]:
        assert _rule_lists(op, "gpu", "NVIDIA A100-SXM4-80GB", args, kwargs) == (op.priority("gpu"), None)
        assert _rule_lists(op, "tpu", "TPU v5 lite", args, kwargs) == (op.priority("tpu"), None)


def test_the_oracle_head_dims_are_the_kernels():
    assert tuple(pallas_gpu_attention._HEAD_DIMS) == _HEAD_DIMS
