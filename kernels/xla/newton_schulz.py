"""Newton-Schulz orthogonalisation reference: the plain iteration in jax.numpy.

`newton_schulz(g, spec=NewtonSchulzSpec(steps, (a, b, c), eps))` on [..., M, N]: transpose when
M > N, X = g / (||g||_F + eps) in f32, then `steps` times A = X X^T, B = b A + c A A,
X = a X + B X with bf16 operands and f32 accumulation (kernels/common/newton_schulz.py has the
math). Output in g's dtype. Its gradient, the autodiff of the same iteration in f32 (a
custom_vjp), is every backend's.
"""

from __future__ import annotations

from jaxtyping import Array, Float

from forgeax.core.registry import Implementation
from forgeax.kernels.common.newton_schulz import NewtonSchulzSpec, reference


def newton_schulz(g: Float[Array, "*B M N"], *, spec: NewtonSchulzSpec) -> Float[Array, "*B M N"]:
    return reference(g, spec=spec)


NEWTON_SCHULZ = Implementation(fn=newton_schulz)
