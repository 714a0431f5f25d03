"""XLA references: plain jax.numpy, f32 statistics; the oracle every other backend is tested against."""
