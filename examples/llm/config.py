"""Model, ops and training configuration of the LLM example, and the named presets.

`OPS` maps each config key to the forgeax op it drives. A setting is "auto" (measure the
backends that run here at the model's shapes and cache the fastest, see autotune.py), "xla"
(the reference), or a backend name the op registers ("cudnn", "triton", "pallas", ...).
"""

from __future__ import annotations

import dataclasses

# config key -> forgeax op name
OPS = {
    "norm": "rms_norm",
    "residual_norm": "add_rms_norm",
    "rope": "rope_qk",
    "attention": "attention",
    "mlp": "gated_mlp",
    "loss": "linear_cross_entropy",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    seq_len: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"  # compute dtype; parameters and optimizer state stay float32
    remat: bool = False  # recompute each layer's activations in the backward (jax.checkpoint)
    # The layers' loop: written out (lax.scan fully unrolled: XLA sees straight-line code, the
    # fastest step) or kept as one loop body (compile time flat in depth: each op is lowered and,
    # under a mesh, partitioned once instead of once per layer).
    unroll_layers: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")

    def num_params(self) -> int:
        d, f, h = self.d_model, self.d_ff, self.head_dim
        attn = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embed + d


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpsConfig:
    norm: str = "auto"
    residual_norm: str = "auto"
    rope: str = "auto"
    attention: str = "auto"
    mlp: str = "auto"
    loss: str = "auto"

    @classmethod
    def all(cls, setting: str, **overrides: str) -> "OpsConfig":
        return cls(**{**{k: setting for k in OPS}, **{k: v for k, v in overrides.items() if v is not None}})

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # Learns visibly on a 2-core CPU in under two minutes (byte-level, ~0.8M parameters).
    "tiny": ModelConfig(),
    # ~1.0B parameters (Llama-style proportions), bf16, sequence 4096: the GPU benchmark.
    "1b": ModelConfig(vocab=32768, d_model=2048, n_layers=18, n_heads=16, n_kv_heads=8, d_ff=5632,
                      seq_len=4096, tie_embeddings=False, rope_theta=500000.0, dtype="bfloat16"),
}
