"""Pallas kernels: gpu/ (Mosaic GPU, Hopper) and tpu/ (Mosaic TPU)."""
