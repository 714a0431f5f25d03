"""Mosaic GPU kernels written with plgpu.kernel (Hopper and newer)."""
