"""Rotary position embedding: the options every backend shares, and its frequencies.

With rotary_dim R (even, <= H) and inverse frequencies inv_freq[i] = theta^(-2i/R),
i < R/2, position p rotates the pair (a_i, b_i) of each head vector by the angle
p * inv_freq[i]:

    a' = a cos - b sin,   b' = b cos + a sin      (x_pair * e^{i angle}, as a complex number)

GPT-NeoX layout (half-split, the default): a_i = x[i], b_i = x[i + R/2].
GPT-J layout (interleaved):                a_i = x[2i], b_i = x[2i + 1].
Elements R..H-1 pass through untouched. The backward is the inverse rotation (angle -> -angle).

Angles are f32(p) * f32(inv_freq) rounded to f32 in every backend, so backends agree up to
the cos/sin evaluation. Llama-3.1 scaling (`Llama3Scaling`) rescales inv_freq by wavelength:
long wavelengths (> original_max_position / low_freq_factor) are divided by `factor`, short
ones (< original_max_position / high_freq_factor) kept, and the band between interpolated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3Scaling:
    """Llama-3.1's frequency scaling of RoPE (the values Llama-3.1 ships with by default)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"scaling.{name}: expected a finite number > 0, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"scaling.high_freq_factor: expected > low_freq_factor ({self.low_freq_factor}), "
                             f"got {self.high_freq_factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """The normalised options of one rope call (the public function builds it once)."""

    rotary_dim: int
    theta: float = 10000.0
    interleaved: bool = False
    scaling: Llama3Scaling | None = None

    @property
    def half(self) -> int:
        return self.rotary_dim // 2


def inverse_frequencies(spec: RopeSpec) -> np.ndarray:
    """inv_freq[i], i < rotary_dim / 2, as f32 (computed in f64, rounded once)."""
    inv = 1.0 / spec.theta ** (np.arange(0, spec.rotary_dim, 2, dtype=np.float64) / spec.rotary_dim)
    s = spec.scaling
    if s is not None:
        wavelength = 2 * math.pi / inv
        low_wavelength = s.original_max_position / s.low_freq_factor
        high_wavelength = s.original_max_position / s.high_freq_factor
        smooth = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        interpolated = (1 - smooth) * inv / s.factor + smooth * inv
        inv = np.where(wavelength > low_wavelength, inv / s.factor,
                       np.where(wavelength < high_wavelength, inv, interpolated))
    return inv.astype(np.float32)


def pair_indices(spec: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
    """(first, second): the element indices of a_i and b_i, i < rotary_dim / 2."""
    i = np.arange(spec.half)
    if spec.interleaved:
        return 2 * i, 2 * i + 1
    return i, i + spec.half
