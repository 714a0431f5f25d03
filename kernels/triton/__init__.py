"""Triton kernels called through jax-triton (NVIDIA GPUs; Triton interpreter on CPU)."""
