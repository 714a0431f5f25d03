"""forgeax.ops: the public functions. Each picks the best backend for the call.

    from forgeax import ops
    y = ops.rms_norm(x, scale)                    # best backend for this device
    y = ops.rms_norm(x, scale, backend="triton")  # that backend, or UnsupportedError
"""

from forgeax.core import (
    OPS,
    Decision,
    Explanation,
    Implementation,
    KernelConfig,
    UnsupportedError,
    current_platform,
    define_op,
    explain,
    interpret_enabled,
    interpret_mode,
    register_backend,
)
from forgeax.ops.add_rms_norm import add_rms_norm
from forgeax.ops.attention import attention
from forgeax.ops.cross_entropy import cross_entropy
from forgeax.ops.gated_mlp import gated_mlp
from forgeax.ops.gated_linear_attention import gated_linear_attention, gated_linear_attention_step, lightning_attention
from forgeax.ops.linear_cross_entropy import linear_cross_entropy
from forgeax.ops.linear_recurrence import linear_recurrence
from forgeax.ops.mean_pool import mean_pool
from forgeax.ops.mla_decode import mla_decode
from forgeax.ops.moe import moe_mlp
from forgeax.ops.newton_schulz import newton_schulz
from forgeax.ops.norms import layer_norm, rms_norm
from forgeax.ops.paged_attention import decode_attention, paged_attention
from forgeax.ops.ragged_dot import ragged_dot, ragged_dot_transposed
from forgeax.ops.ragged_paged_attention import ragged_paged_attention
from forgeax.ops.rope import Llama3Scaling, rope, rope_qk
from forgeax.ops.sparse_attention import sparse_attention
from forgeax.ops.ring_attention import from_zigzag, pad_to_ring, ring_attention, to_zigzag

__all__ = [
    "OPS",
    "Decision",
    "Explanation",
    "Implementation",
    "Llama3Scaling",
    "KernelConfig",
    "UnsupportedError",
    "add_rms_norm",
    "attention",
    "cross_entropy",
    "current_platform",
    "decode_attention",
    "define_op",
    "explain",
    "from_zigzag",
    "gated_linear_attention",
    "gated_linear_attention_step",
    "gated_mlp",
    "interpret_enabled",
    "interpret_mode",
    "layer_norm",
    "lightning_attention",
    "linear_cross_entropy",
    "linear_recurrence",
    "mean_pool",
    "mla_decode",
    "moe_mlp",
    "newton_schulz",
    "pad_to_ring",
    "paged_attention",
    "ragged_dot",
    "ragged_dot_transposed",
    "ragged_paged_attention",
    "register_backend",
    "ring_attention",
    "rms_norm",
    "rope",
    "rope_qk",
    "sparse_attention",
    "to_zigzag",
]
